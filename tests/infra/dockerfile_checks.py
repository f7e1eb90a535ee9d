"""Structure of the training image's Dockerfile, as pure checks on its text.

hadolint checks the practices; these check the project's own rules: the CPU
and CUDA variants, torch and the package installed under constraints.txt,
a non-root user, nothing fetched at run time, and every copied path present
in the build context (not excluded by .dockerignore).
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        pending += " " + stripped.removesuffix("\\") if pending else stripped.removesuffix("\\")
        if not stripped.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    return out


def stages(steps: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """The instructions of each stage, by its name (``final`` for the last, unnamed stage)."""
    out: dict[str, list[tuple[str, str]]] = {}
    current = None
    for word, args in steps:
        if word == "FROM":
            match = re.search(r"\s+AS\s+(\S+)$", args, re.IGNORECASE)
            current = match.group(1) if match else "final"
            out[current] = [(word, args)]
        elif current is not None:
            out[current].append((word, args))
    return out


def variant_problems(text: str) -> list[str]:
    """``ARG VARIANT=cpu`` chooses between a CPU stage and a CUDA stage built on a CUDA image."""
    steps = instructions(text)
    problems = []
    first_from = next(i for i, (w, _) in enumerate(steps) if w == "FROM")
    if ("ARG", "VARIANT=cpu") not in steps[:first_from]:
        problems.append("ARG VARIANT=cpu must come before the first FROM")
    by_name = stages(steps)
    cpu, cuda, final = by_name.get("base-cpu"), by_name.get("base-cuda"), by_name.get("final")
    if cpu is None or cuda is None or final is None:
        return problems + [f"need stages base-cpu, base-cuda and a final one, got {sorted(by_name)}"]
    if not cuda[0][1].startswith("nvidia/cuda:"):
        problems.append("the CUDA variant must build on an nvidia/cuda image")
    if not any("download.pytorch.org/whl/cpu" in args for _, args in cpu):
        problems.append("the CPU variant must install torch from the CPU index")
    if not final[0][1].startswith("base-${VARIANT}"):
        problems.append("the final stage must build FROM base-${VARIANT}")
    return problems


def install_problems(text: str) -> list[str]:
    """Every pip install is held by constraints.txt; nothing is added from a URL."""
    problems = []
    for word, args in instructions(text):
        if word == "ADD":
            problems.append(f"ADD {args}: use COPY (ADD fetches URLs and unpacks archives)")
        if word == "RUN":
            for command in re.split(r"&&|;", args):
                if "pip install" in command and "-c constraints.txt" not in command:
                    problems.append(f"pip install without -c constraints.txt: {command.strip()}")
    return problems


def runtime_problems(text: str) -> list[str]:
    """A numeric non-root user, the entrypoint script, and the Hugging Face libraries offline."""
    steps = instructions(text)
    final = stages(steps).get("final", [])
    problems = []
    users = [args for word, args in final if word == "USER"]
    if not users or users[-1].split(":")[0] in ("0", "root"):
        problems.append("the final stage must end as a non-root USER")
    args_of = {word: args for word, args in final}
    uid = re.search(r"ARG UID=(\d+)", text)
    if users and not (users[-1].split(":")[0].isdigit() or (uid and users[-1].startswith("${UID}"))):
        problems.append(f"USER {users[-1]} must be numeric")
    if "elastic-ft-entrypoint" not in args_of.get("ENTRYPOINT", ""):
        problems.append("ENTRYPOINT must be the elastic-ft entrypoint script")
    env = " ".join(args for word, args in final if word == "ENV")
    for name in ("HF_HUB_OFFLINE=1", "HF_DATASETS_OFFLINE=1", "TRANSFORMERS_OFFLINE=1"):
        if name not in env:
            problems.append(f"ENV {name} missing: the image must not fetch from the hub at run time")
    return problems


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore ``patterns`` exclude ``path`` (last match wins; ``!`` re-includes)."""
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p, "*/" + pattern.removeprefix("**/"))
               for p in prefixes):
            result = not negate
    return result


def context_problems(text: str, repo: Path) -> list[str]:
    """Every COPY source exists in the repository and is sent in the build context."""
    ignore = repo / ".dockerignore"
    patterns = [line.strip() for line in ignore.read_text().splitlines()
                if line.strip() and not line.startswith("#")] if ignore.exists() else []
    problems = []
    for word, args in instructions(text):
        if word != "COPY" or "--from=" in args:
            continue
        sources = [a for a in args.split() if not a.startswith("--")][:-1]
        for source in sources:
            if not (repo / source).exists():
                problems.append(f"COPY {source}: no such path in the repository")
            elif ignored(source, patterns):
                problems.append(f"COPY {source}: excluded by .dockerignore")
    return problems
