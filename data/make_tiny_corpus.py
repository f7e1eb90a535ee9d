"""Writes data/tiny-corpus.jsonl: the small prompt/response corpus the default
job fine-tunes on (two-digit additions phrased a few ways). Deterministic; run
it again only to change the corpus: `python data/make_tiny_corpus.py`."""

import json
import os
import random

TEMPLATES = [
    ("What is {a} plus {b}?", " {c}."),
    ("Add {a} and {b}.", " The sum is {c}."),
    ("{a} + {b} =", " {c}"),
    ("Compute the sum of {a} and {b}.", " {a} + {b} = {c}."),
]

rng = random.Random(20261121)
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny-corpus.jsonl")
with open(path, "w") as f:
    for _ in range(1024):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        prompt, response = rng.choice(TEMPLATES)
        row = {"prompt": prompt.format(a=a, b=b, c=a + b), "response": response.format(a=a, b=b, c=a + b)}
        f.write(json.dumps(row) + "\n")
