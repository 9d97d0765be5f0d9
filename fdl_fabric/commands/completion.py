"""Shell completion for ``fdl-fabric``: ``eval "$(fdl-fabric --completion bash)"``.

Invoke's own completion knows only its tasks, not ``run`` (torchrun's command line,
parsed by argparse), so the script is written here from the one source of each
command's flags: `vocabulary`. It is a static script (no
Python runs at each Tab) for bash; zsh loads it through ``bashcompinit``.
"""

from __future__ import annotations

from . import vocabulary
from .vocabulary import COMMANDS

SHELLS = ("bash", "zsh")


def flags_of(command: str) -> list[str]:
    """Every spelling of every flag of ``command`` (`vocabulary`, the one table)."""
    return sorted({w for f in vocabulary.flags_of(command) for w in f.spellings}
                  | {"-h", "--help"})


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
