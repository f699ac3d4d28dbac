"""What the engine does differently for an encoder-decoder model (T5): a request's prompt feeds the
encoder and its decoder starts from the model's decoder prompt, and a request must fit the cache
with its cross-attention blocks. Everything else (scheduling, blocks, decoding strategies) is the
decoder-only path; see BlockManager for the cross blocks and ModelRunner for the encoder step."""
from __future__ import annotations

from typing import Optional

from eecore.engine.block_manager import BlockManager
from eecore.engine.sequence import Sequence
from eecore.sampling_params import SamplingParams


def encoder_decoder_sequence(model, token_ids: list[int], params: SamplingParams, index: int,
                             prompt: Optional[str]) -> Sequence:
    return Sequence(model.decoder_prompt(), params, request_index=index, prompt=prompt, encoder_token_ids=token_ids)


def check_request_fits(model, blocks: BlockManager, token_ids: list[int], params: SamplingParams, index: int,
                       max_model_len: int, lookahead: int) -> None:
    """A request alone must fit the cache at its longest (encoder blocks plus the decoder's), or
    preemption could never make room for it."""
    probe = Sequence(model.decoder_prompt(), params, encoder_token_ids=token_ids)
    decoder_tokens = min(max_model_len, len(probe.prompt_token_ids) + params.max_tokens) + lookahead
    need = blocks.blocks_for_request(probe, decoder_tokens)
    if need > blocks.num_blocks:
        raise ValueError(
            f"prompt {index}: its {len(token_ids)} encoder tokens and up to {decoder_tokens} decoder tokens need "
            f"{need} KV blocks of {blocks.block_size} tokens, but the cache has {blocks.num_blocks}; shorten the "
            f"prompt, lower max_tokens, or give the engine more blocks")
