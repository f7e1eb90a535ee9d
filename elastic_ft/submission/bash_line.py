"""The ``bash -c`` line every node runs, and the environment names bash itself would act on.

Every argument is quoted for bash, whatever it holds: a user's endpoint, spec
path or override reaches torchrun as one word and is never expanded, on
``local_cwd`` as in a Batch container. The one exception is the component's
own rank-0 endpoint, which names the scheduler's rank-0 host variable for bash
to expand (as torchx's ``dist.ddp`` does); it is a constant of this module,
recognised by identity, so no text that came from a user can be left unquoted.

torchx substitutes its macros (``${app_id}``, ``${replica_id}``, ...) in the
line after quoting, as in its own components; the values are scheduler-made
names, and inside single quotes they stay text.
"""

from __future__ import annotations

import re
import shlex
from typing import Sequence

from torchx.specs import macros


class _Expanded(str):
    """Text bash must expand; its only instance is :data:`RANK0_ENDPOINT`."""


RANK0_ENDPOINT = _Expanded(f"${{{macros.rank0_env}:=localhost}}:29500")
"""c10d's endpoint on several nodes: the scheduler's rank-0 host (torchx fills in the variable's
name), else localhost, port 29500 (the role's ``c10d`` port). Left unquoted so that bash expands it."""

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""What a node's environment variable may be called: a shell variable name. bash imports a variable
named like ``BASH_FUNC_torchrun%%`` as a function, which would replace the torchrun command."""

BASH_START_VARIABLES = ("BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "BASH_XTRACEFD", "PS4")
"""Variables a non-interactive ``bash -c`` acts on before it runs the line: ``BASH_ENV`` (and ``ENV``
in POSIX mode) name a file bash sources first, ``SHELLOPTS``/``BASHOPTS`` turn on options such as
xtrace, whose ``PS4`` prompt is expanded, command substitutions included. Given through ``--env``
they would run commands ahead of torchrun on every node."""


def bash_line(cmd: Sequence[str]) -> str:
    """``cmd`` as one ``bash -c`` line: every argument quoted but :data:`RANK0_ENDPOINT` itself."""
    # By identity: an equal string from a user is quoted like any other.
    return " ".join(a if a is RANK0_ENDPOINT else shlex.quote(a) for a in cmd)
