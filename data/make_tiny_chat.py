"""Writes data/tiny-chat.jsonl: the small chat corpus of specs/tiny-chat-lora.yaml (conversations in the
OpenAI / Hugging Face ``messages`` format: one to three user/assistant exchanges about two-digit sums, a
system message in some). Deterministic; run it again only to change the corpus:
`python data/make_tiny_chat.py`."""

import json
import os
import random

SYSTEMS = ["You add numbers.", "Answer with the sum only.", "Be brief."]
FIRST = [("What is {a} plus {b}?", "{c}."), ("Add {a} and {b}.", "The sum is {c}."), ("{a} + {b} =", "{c}")]
MORE = [("And plus {d}?", "{e}."), ("Add {d} to that.", "That makes {e}.")]
THANKS = [("Thanks!", "You are welcome."), ("Thank you.", "Glad to help.")]

rng = random.Random(20261203)
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny-chat.jsonl")
with open(path, "w") as f:
    for n in range(48):
        a, b, d = rng.randint(10, 99), rng.randint(10, 99), rng.randint(1, 9)
        values = {"a": a, "b": b, "c": a + b, "d": d, "e": a + b + d}
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if n % 3 == 0 else []
        exchanges = [rng.choice(FIRST)]
        if n % 2 == 0:
            exchanges.append(rng.choice(MORE))
        if n % 4 in (1, 2):
            exchanges.append(rng.choice(THANKS))
        for user, assistant in exchanges:
            messages.append({"role": "user", "content": user.format(**values)})
            messages.append({"role": "assistant", "content": assistant.format(**values)})
        f.write(json.dumps({"messages": messages}) + "\n")
