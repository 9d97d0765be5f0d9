"""Shell completion for ``fdl-fabric``: ``eval "$(fdl-fabric --completion bash)"``.

Invoke's own completion knows only its tasks, not ``run`` (torchrun's command line,
parsed by argparse), so the script is written here from the one source of each
command's flags: the task's arguments and ``run``'s parser. It is a static script (no
Python runs at each Tab) for bash; zsh loads it through ``bashcompinit``.
"""

from __future__ import annotations

from .cli import COMMANDS
from .run import parser

SHELLS = ("bash", "zsh")


def flags_of(command: str) -> list[str]:
    """Every spelling of every flag of ``command``."""
    if command == "run":
        return sorted({o for a in parser()._actions for o in a.option_strings})
    from ..tasks import ns

    task = ns.tasks[command]
    names: set[str] = set()
    for argument in task.get_arguments():
        for name in argument.names:
            names.add(f"-{name}" if len(name) == 1 else f"--{name}")
        if argument.kind is bool and argument.default is True:
            names.add(f"--no-{argument.names[0]}")
    return sorted(names | {"--help"})


def script(shell: str) -> str:
    """The completion script for ``shell`` (bash or zsh)."""
    if shell not in SHELLS:
        raise ValueError(f"expected one of {', '.join(SHELLS)}, got {shell!r}")
    cases = "".join(f"    {c}) opts=\"{' '.join(flags_of(c))}\" ;;\n" for c in COMMANDS)
    body = f"""\
# fdl-fabric completion ({shell}): eval "$(fdl-fabric --completion {shell})"
_fdl_fabric() {{
  local cur="${{COMP_WORDS[COMP_CWORD]}}" opts=""
  if [ "$COMP_CWORD" -eq 1 ]; then
    COMPREPLY=($(compgen -W "{' '.join(COMMANDS)} --help" -- "$cur"))
    return 0
  fi
  case "${{COMP_WORDS[1]}}" in
{cases}  esac
  if [[ "$cur" == -* ]]; then
    COMPREPLY=($(compgen -W "$opts" -- "$cur"))
  else
    COMPREPLY=($(compgen -f -- "$cur"))
  fi
}}
complete -o default -F _fdl_fabric fdl-fabric
"""
    if shell == "zsh":
        body = ("(( $+functions[compdef] )) || { autoload -U +X compinit && compinit -u; }\n"
                "autoload -U +X bashcompinit && bashcompinit\n" + body)
    return body
