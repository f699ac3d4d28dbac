"""Sequence utilities shared by exits/, speculative/ and evaluation/, with no dependency on any other
eecore package (tests/test_imports.py holds this package a leaf):

    ngram_index.py   NgramIndex, PromptLookup: the prompt-lookup (n-gram) index of a token sequence,
                     drafting for self-speculation and an input of the exit decision
    rouge.py         rouge_l: ROUGE-L F1 of two texts on whitespace tokens (eecore eval, calibration)
"""
