"""Every bound a cluster file is held to, in one place, each with the reason for its value.

A cluster file is input: whatever it says, reading it must finish quickly, in bounded memory,
and either produce a plan or exit 2 with a message naming the key and line. Without bounds a
one-line file can ask for a billion ranks (the plan then eats all memory) or point at
``/dev/zero``. ``config`` enforces these values, ``ssh`` reuses the ones about SSH, and
docs/cluster-yml.md lists them; change a value here and the whole program follows.

The sizing target is a 1,000-host cluster with headroom: four times the hosts, more ranks per
host than any machine has cores or GPUs, and exec-level limits taken from Linux. Standard
library only, so anything can import it.

The last section holds the launcher's own bounds at run time: the open files a launch needs,
and how much a tunnel may carry.
"""

from __future__ import annotations

__all__ = [
    "BEATS_EVERY_MAX",
    "BEATS_PER_TIMEOUT",
    "ARG_STRLEN_MAX",
    "ON_EXIT_SECONDS",
    "RECORD_FLUSH_S",
    "RECORD_LOG_BYTES",
    "RECORD_QUEUE_BYTES",
    "RECORD_STALL_S",
    "RECORDS_BYTES_MAX",
    "RECORDS_KEPT",
    "COMMAND_MAX_BYTES",
    "DEPTH_MAX",
    "ENV_MAX_BYTES",
    "ENV_NAME_MAX",
    "ENV_VARS_MAX",
    "FILE_MAX_BYTES",
    "HOST_LABEL_MAX",
    "HOST_NAME_MAX",
    "MERGED_ENTRIES_MAX",
    "LOG_FILES_OPEN",
    "NOFILE_BASE",
    "NOFILE_PENDING_MIN",
    "NOFILE_PER_HOST",
    "NOFILE_PER_RELAY",
    "NUMBER_MAX_CHARS",
    "PATH_MAX_BYTES",
    "PORT_MAX",
    "PROBLEMS_MAX",
    "RANKS_MAX",
    "RANKS_PER_WORKER_MAX",
    "RESTARTS_MAX",
    "SECONDS_MAX",
    "SSH_OPTIONS_MAX",
    "SSH_OPTION_MAX_BYTES",
    "TUNNEL_CONNECTIONS",
    "TUNNEL_FDS_FIXED",
    "TUNNEL_FDS_PER_CONNECTION",
    "TUNNEL_FD_RESERVE",
    "TUNNEL_FIRST_FRAME_MAX",
    "TUNNEL_WAITING_MAX",
    "TUNNEL_WAITING_SECONDS",
    "USER_NAME_MAX",
    "WORKERS_MAX",
]

#: The cluster file itself. A file for 1,000 hosts with an ssh block, env and 8 GPUs each
#: is about 0.3 MiB. The worst 1 MiB file (half a million one-letter list items) takes
#: about 1.6 s and 130 MB to read with libyaml's parser, 9 s and 210 MB without it. Anything
#: bigger is not a cluster description.
FILE_MAX_BYTES = 1 << 20

#: Nesting of YAML collections. The schema needs 5 (top > workers > worker > ssh > options);
#: 32 leaves room for anchors under ``x-`` keys while keeping the composer's recursion (a few
#: frames per level) far from Python's recursion limit.
DEPTH_MAX = 32

#: Hosts. 4x a 1,000-host cluster; the launcher keeps one SSH connection per worker.
WORKERS_MAX = 4096

#: Ranks on one worker (``nproc``, entries of ``local_devices``, and so the largest GPU index
#: + 1). Today's largest machines have a few hundred hardware threads or 16 GPUs.
RANKS_PER_WORKER_MAX = 1024

#: Ranks in the whole job: 64 per host on 1,000 hosts. The plan holds one environment per
#: rank; at this size it takes about 0.1 GB, or 0.5 GB with ``ENV_VARS_MAX`` variables each
#: (measured, under a second either way).
RANKS_MAX = 65536

#: ``elastic.max_restarts`` / ``--max-restarts``: attempts beyond the first. More than this
#: is a crash loop, not elasticity.
RESTARTS_MAX = 1000

#: Linux MAX_ARG_STRLEN (32 pages) counts the terminating NUL, so one argv word or one
#: ``NAME=value`` environment string may have at most this many bytes. Longer ones make
#: execve fail with E2BIG on the host, after everything else has started.
ARG_STRLEN_MAX = 32 * 4096 - 1

#: The ``command`` string. Must fit a 200 KB argv written as many words plus quoting; the
#: argv and environment of one exec share ARG_MAX (2 MiB with the default 8 MiB stack), and
#: ``ENV_MAX_BYTES`` takes half of it.
COMMAND_MAX_BYTES = 256 * 1024

#: An environment variable name. POSIX sets no limit; no real name comes close.
ENV_NAME_MAX = 256

#: Variables a rank gets from the file (the cluster ``env`` and its worker's ``env``, a name
#: counted once). Real files set tens; the plan copies them into every rank's environment,
#: so this times ``RANKS_MAX`` is what the plan can hold.
ENV_VARS_MAX = 256

#: Bytes of ``NAME=value`` strings a rank gets from the file: half of ARG_MAX (2 MiB), the
#: other half being the command and the launcher's own variables. Aliases let a small file
#: repeat one big value, so this is checked on the resolved values, not on the file size.
ENV_MAX_BYTES = 1 << 20

#: ``path``, ``data_path``, ``identity_file`` and file options in bytes: Linux PATH_MAX.
PATH_MAX_BYTES = 4096

#: DNS (RFC 1035): a name of at most 253 characters made of labels of at most 63.
HOST_NAME_MAX = 253
HOST_LABEL_MAX = 63

#: A login name (``ssh.user``, ``user@`` in a target or jump host); useradd's default is 32.
USER_NAME_MAX = 64

#: TCP ports: 0 is not a port one can connect to (paramiko would quietly use 22).
PORT_MAX = 65535

#: ``ssh.options`` entries per worker. OpenSSH has about 100 options in all and we support
#: 11; an alias could otherwise repeat a long list in every worker.
SSH_OPTIONS_MAX = 64

#: One ``ssh.options`` entry: a path (PATH_MAX) plus its key, with room to spare.
SSH_OPTION_MAX_BYTES = 8192

#: Durations in seconds (``kill_grace``, elastic timeouts, ssh timeouts): about 11.6 days,
#: far below threading.TIMEOUT_MAX, so every wait the launcher does with them is valid.
SECONDS_MAX = 1_000_000

#: Characters of a YAML number. Real numbers are short, and some YAML 1.1 forms
#: (sexagesimal ``1:2:3``) take quadratic time to construct.
NUMBER_MAX_CHARS = 100

#: Entries copied by ``<<`` merge keys in the whole file: 4096 workers each merging a
#: 256-variable env and a 10-key defaults mapping need about 1.1 million. A chain of merges
#: could otherwise make quadratic work out of a small file.
MERGED_ENTRIES_MAX = 1 << 21

#: Problems listed before reading stops. A file can repeat one broken mapping through
#: aliases; 100 lines are enough to fix a file in one pass.
PROBLEMS_MAX = 100

# -- the launcher's own resources at run time ---------------------------------------------------
# What one launch holds open, so it can be checked against RLIMIT_NOFILE before anything starts
# (`fdl_fabric.transport.openfiles.check_open_files`) and so a tunnel never takes what the agents'
# sessions need. With paramiko an SSH connection is one socket; a session read by the
# launcher's channel reader is a pipe besides (its ``fileno()``), forwarded channels none.

#: An agent folds its ranks' heartbeats into one BEATS frame this often: a tenth of
#: ``heartbeat_timeout`` (or ``hang_timeout``, when shorter), between a rank's own beat
#: (1 s) and `BEATS_EVERY_MAX`. Each rank's age in the frame is exact, so a frozen rank is
#: found within the timeout however seldom the frames go; a live one looks at most this
#: much older than it is.
BEATS_PER_TIMEOUT = 10
BEATS_EVERY_MAX = 3.0

#: Rank log files (stdout.log, stderr.log) one run log holds open at once; the others are
#: opened again by their next write (`presentation.rotating.FilePool`).
LOG_FILES_OPEN = 128

#: Open files a launch needs whatever the cluster: the standard streams, the screen writer,
#: selectors and wake-up pairs, imports, DNS, a reconnect or two in flight, and the rank
#: logs of the run's record and of ``--log-dir`` (`LOG_FILES_OPEN` each).
NOFILE_BASE = 64 + 2 * LOG_FILES_OPEN

#: Per host connected directly: its SSH connection (one socket) and its agent session's
#: pipe (two), or a local or Slurm agent's three pipes, and room for a reconnect's socket
#: while the old one closes. A gateway's relay session adds a pipe (`NOFILE_PER_RELAY`);
#: a gateway's leaves cost the launcher nothing.
NOFILE_PER_HOST = 6

#: Per gateway: its relay session's pipe.
NOFILE_PER_RELAY = 2

#: Connections the coordinator's port may hold before their hello (`admission.PENDING_MAX`):
#: ranks reach it through their agents' sessions, so nothing here grows with the world.
NOFILE_PENDING_MIN = 256

#: Forwarded connections one tunnel carries at once, whatever the ranks of its host: the
#: launcher's ranks reach the coordinator through their agent's session (issue 35), so a
#: tunnel carries only ranks run by hand on that host and the agent's pre-flight dial.
TUNNEL_CONNECTIONS = 16

#: Open files one forwarded connection costs the launcher: its socket to the coordinator and
#: the coordinator's end of it (the channel itself costs none).
TUNNEL_FDS_PER_CONNECTION = 2

#: Open files one tunnel costs whatever it carries: its selector and its wake-up socket pair.
TUNNEL_FDS_FIXED = 3

#: Open files a tunnel leaves free whatever its bound: a forwarded connection gets no socket
#: when taking one would leave fewer than this under the soft limit (the agents' sessions,
#: reconnects and log files come first).
TUNNEL_FD_RESERVE = 64

#: Bytes of the first frame a forwarded connection must send before it gets a socket to the
#: coordinator: the coordinator's own bound before a hello is verified (a hello or the agent's
#: probe is a few hundred bytes). A connection whose first four bytes announce more (or less
#: than a tag) is no rank's and is turned away at once.
TUNNEL_FIRST_FRAME_MAX = 4096

#: Forwarded connections waiting for their first whole frame, held by one tunnel, and as many
#: again whose frame is in and wait for room under the bound. They cost no open file (the
#: socket to the coordinator is opened once the frame is in: a rank speaks first), only a
#: paramiko channel and the frame. Beyond this, of those without a frame the one that has
#: waited longest is closed (a rank sends its hello within a round trip of connecting, and
#: an idle flood never does); of those with one, the newest is refused.
TUNNEL_WAITING_MAX = 256

#: A forwarded connection that has not sent its first frame after this many seconds is
#: closed (the coordinator gives a connection as long for its hello), and so is one whose
#: frame has waited this long for a place under the bound.
TUNNEL_WAITING_SECONDS = 10.0


# -- the controller's run records (`fdl_fabric.runs`) ------------------------------------------
#: A record's console.log and each rank's stdout.log/stderr.log rotate past this size: the
#: file is renamed ``<name>.1`` (replacing the one before) and a new one starts, so one
#: rank that prints without end holds at most twice this on the controller's disk.
RECORD_LOG_BYTES = 64 << 20
#: A run's logs are written by a thread of their own (`presentation.deferred`): at most
#: this much waits for it (rank output by its bytes, an event as 512).
RECORD_QUEUE_BYTES = 32 << 20
#: A thread with more to hand over waits at most this long for the log's writer; past it
#: the disk is taken as stalled and the log is given up (said once), the run going on.
RECORD_STALL_S = 30.0
#: How long the launcher waits for a log's writer to catch up before its verdict and
#: at its close (what is still queued then is said lost with the log).
RECORD_FLUSH_S = 10.0
#: Records kept on the controller: the newest this many ended runs; older ones are pruned
#: when a run starts. A live run's record is never pruned.
RECORDS_KEPT = 100
#: Bytes all ended runs' records may hold together; the oldest go first past it.
RECORDS_BYTES_MAX = 4 << 30
#: Seconds an ``--on-exit`` hook may run before it is stopped (TERM, then KILL 5 s later):
#: long enough for a mail or a webhook, short enough that a hung one never holds a run's
#: end for long.
ON_EXIT_SECONDS = 60.0
