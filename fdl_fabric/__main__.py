"""``python -m fdl_fabric``: the ``fdl-fabric`` command (`commands.prestart.main`)."""

from .commands.prestart import main

main()
