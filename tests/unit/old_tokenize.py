"""The data path before the token store (``train/data.py: tokenize`` until issue 25), kept only as the
reference the store's samples must equal token for token, and as bench/data.py's baseline: every record
read as Python objects (:func:`read_json_lines`), Python lists of every sample, then ``(n, max_length)``
tensors padded to ``max_length``."""

from __future__ import annotations

import torch

from elastic_ft.train.datafiles import json_records

IGNORE = -100


def read_json_lines(paths: list[str]) -> list[dict]:
    """Every record of the JSON Lines files ``paths``, in order, held as Python objects (the loader before the
    store; read through the trainer's own line reader, so the same records)."""
    return [value for _, _, value in json_records(paths)]


def old_tokenize(texts: dict[str, list[str]], cfg, tokenizer) -> dict[str, torch.Tensor]:
    """``texts``: the needed columns of the records, in order."""
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    prefix = [bos] if bos is not None else []
    length = cfg.max_length
    rows: list[tuple[list[int], list[int]]] = []

    def encode(field):
        return tokenizer(texts[field], add_special_tokens=False)["input_ids"]

    if cfg.prompt_field:
        prompts, responses = encode(cfg.prompt_field), encode(cfg.response_field)
        for p, r in zip(prompts, responses):
            ids = (prefix + p + r + [eos])[:length]
            labels = ([IGNORE] * (len(prefix) + len(p)) + r + [eos])[:length]
            rows.append((ids, labels))
    elif cfg.packing:
        stream: list[int] = []
        for ids in encode(cfg.text_field):
            stream += prefix + ids + [eos]
        for start in range(0, len(stream) - length + 1, length):
            block = stream[start : start + length]
            rows.append((block, list(block)))
    else:
        for ids in encode(cfg.text_field):
            ids = (prefix + ids + [eos])[:length]
            rows.append((ids, list(ids)))
    n = len(rows)
    input_ids = torch.full((n, length), pad, dtype=torch.long)
    labels = torch.full((n, length), IGNORE, dtype=torch.long)
    mask = torch.zeros((n, length), dtype=torch.long)
    for i, (ids, labs) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(labs)] = torch.tensor(labs)
        mask[i, : len(ids)] = 1
    target_tokens = (labels[:, 1:] != IGNORE).sum(dim=1)
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask, "target_tokens": target_tokens}
