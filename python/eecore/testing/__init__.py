"""What the tests and benchmarks hold eecore to: `reference`, the pure-PyTorch oracle of every op."""


def accept_every_draft(llm) -> None:
    """Makes `llm`'s self-speculation accept every greedy draft whole, whatever the verify pass says:
    a round then costs what it costs when every draft is right, in any precision and at any batch.
    For benchmarks of a round's cost ("perfect drafts"): the drafts' passes, the verify pass and the
    acceptance all run as usual, but the output is the drafts' text, not the model's. (Taking the
    drafts from full depth's own output instead would hold only where a verify pass rounds exactly
    as a one-row decode step: not in bf16 on a GPU, where near-ties flip and every later draft of
    the sequence then misses.)"""
    acceptor = getattr(llm.engine.strategy, "acceptor", None)
    if acceptor is None:
        raise ValueError("accept_every_draft: the LLM has no self-speculation (LLM(speculative=...))")
    acceptor.accepts_every_draft = True
    fused = getattr(llm.engine.strategy, "fused", None)
    if fused is not None:  # (fused rounds accept on the device: eecore.speculative.fused_round)
        fused.verify.accepts_every_draft = True
