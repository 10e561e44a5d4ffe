"""Receipts: the evidence a change to a kernel is judged by.

    stats     clustered paired se, exact McNemar, Holm, sign test, the verdict rule
    texts     the public texts (files every Debian / Python install has) and their sha256
    metrics   per-row distance to float64 (rel-L2, argmax, KL, worst column) and NLL
    arms      the tail arms and their registry (ArmRegistry, Arm, default_arms)
    engine    rows of SmolLM2 hidden states -> per-row metrics -> paired comparisons
    report    markdown + JSON + PNG plots
    receipt   `lmtail receipt` (configure / run; make_receipt as a library call)
    ab        `lmtail ab`: paired alternating A/B runs of two commands
    hf        the optional HF transformers arm (a separate benchmark interpreter)

Submodules are imported by name (`from lmtail.receipts.stats import holm`); this package
imports nothing itself, so `lmtail --help` stays fast.
"""
