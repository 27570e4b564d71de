"""The three active-vocabulary policies on one drafter: context (NanoSpec), static (FR-Spec), hybrid.

    python examples/policies.py

A frequency table is counted on a small corpus with a toy word tokenizer, saved as a plain text
file and loaded back; each policy then drafts over the same context, and we print which tokens
the head may propose.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.nn as nn

import nanospec_fx
from nanospec_fx import FrequencyTable

CORPUS = """the cat sat on the mat . the dog sat on the log . a cat and a dog met on the mat .
the end of the story is near . the cat ran and the dog ran .""".split("\n")


class WordTokenizer:
    def __init__(self, texts):
        words = sorted({w for t in texts for w in t.split()})
        self.vocab = {w: i for i, w in enumerate(words)}

    def encode(self, text):
        return [self.vocab[w] for w in text.split()]

    def __len__(self):
        return len(self.vocab)


class Drafter(nn.Module):
    def __init__(self, vocab: int, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        return self.lm_head(torch.tanh(self.embed(ids)))


def main() -> None:
    tokenizer = WordTokenizer(CORPUS)
    names = {i: w for w, i in tokenizer.vocab.items()}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "frequencies.txt"
        FrequencyTable.from_texts(CORPUS, tokenizer).save(path)  # plain 'token_id count' lines
        table = FrequencyTable.load(path)
    print("most frequent:", [names[i] for i in table.top(4).tolist()])

    context = torch.tensor([tokenizer.encode("a dog met a cat")])
    for policy, extra in [("context", {}), ("static", {"static_size": 4}), ("hybrid", {"pinned_size": 2})]:
        torch._dynamo.reset()
        drafter = Drafter(len(tokenizer)).eval()
        compiled = torch.compile(drafter, backend="nanospec",
                                 options={"policy": policy, "frequencies": table, "capacity": 8, "inductor": False,
                                          **extra})
        with torch.inference_mode():
            logits = compiled(context)
        state = nanospec_fx.active_vocab(drafter)
        proposable = torch.isfinite(logits[0, -1]).nonzero().flatten().tolist()
        print(f"{policy:8s} active={[names[i] for i in state.token_ids().tolist()]}  "
              f"proposable={sorted(names[i] for i in proposable)}")


if __name__ == "__main__":
    main()
