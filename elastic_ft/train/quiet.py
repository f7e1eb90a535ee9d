"""Silence library output a user of the job cannot act on, so its own lines stay readable.

Each filter names what it hides and why it is noise here: a deprecation
inside a library we call the way it documents, a progress bar of a local
file, a notice about a setting we make on purpose. Warnings of the user's own
making (a bad spec, a missing file) are errors of ours and are not touched.
"""

from __future__ import annotations

import logging
import os
import warnings

# (category, message regex): all raised inside transformers or peft, on calls made as documented.
_WARNINGS = (
    # peft's get_peft_model asks transformers a deprecated question (transformers 5, peft 0.21).
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
)
_LOGGERS = ("transformers", "peft", "datasets", "httpx", "huggingface_hub")


def quiet_libraries() -> None:
    """Filter the known warnings, and the libraries' loggers and progress bars below ERROR.

    Idempotent; call it before the libraries are used (they are imported lazily).
    """
    for category, message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # Read when transformers / huggingface_hub are first imported: their bars over
    # a checkpoint of a few files are noise on a console of one line per event.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
