"""The cluster file: its model, its rules, reading it. Nothing is valid until loaded here.

* `model`: the frozen dataclasses (`ClusterSpec`, `WorkerSpec`, ...) with defaults applied,
  the reserved environment names, ``max_failure``'s meaning;
* `loading`: reading a file (a regular file, at most 1 MiB) and parsing YAML text;
* `schema`: the rules of cluster.yml, one function per block;
* `yamlread`: reading YAML nodes with line numbers and bounds, recording problems;
* `names`: the grammar of host names, users, ssh options, paths and commands;
* `problems`: `Problem` and `ConfigError` (exit 2), which lists every problem at once.
"""

from .loading import load_cluster, parse_cluster, this_host_name
from .model import (
    ENV_NAME_RE,
    JOIN_KIND,
    MASTER_PORT_DEFAULT,
    RESERVED_ENV_KEYS,
    ClusterSpec,
    ControllerSpec,
    ElasticSpec,
    JoinSpec,
    SlurmSpec,
    SshSpec,
    StartMode,
    WorkerSpec,
    is_reserved_env_key,
    parse_max_failure,
)
from .problems import ConfigError, Problem, make_problem

__all__ = [
    "ENV_NAME_RE",
    "JOIN_KIND",
    "MASTER_PORT_DEFAULT",
    "RESERVED_ENV_KEYS",
    "ClusterSpec",
    "ConfigError",
    "ControllerSpec",
    "ElasticSpec",
    "JoinSpec",
    "Problem",
    "SlurmSpec",
    "SshSpec",
    "StartMode",
    "WorkerSpec",
    "is_reserved_env_key",
    "load_cluster",
    "make_problem",
    "parse_cluster",
    "parse_max_failure",
    "this_host_name",
]
