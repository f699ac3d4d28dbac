"""The LayerSkip training recipe (LayerSkip paper, §4.1) for Hugging Face Llama-family causal LMs.

Layer dropout (`layer_dropout`, equations (1)-(4)) plus the early-exit loss (`early_exit_loss`,
equations (5)-(6)), trained with autograd on the Hugging Face modules themselves (eecore's inference
ops are not differentiable). The model gains no parameters: every layer exits through the model's
own final norm and LM head, which is what eecore's early-exit and self-speculative inference use.

    config = LayerSkipConfig(p_max=0.1, e_scale=0.1, exit_curriculum="rotational", rotation=8)
    generator = torch.Generator().manual_seed(0)
    for step, (input_ids, labels) in enumerate(batches):
        out = layerskip_loss(model, input_ids, labels, step, total_steps, config, generator)
        out.loss.backward(); optimizer.step(); optimizer.zero_grad()

or from the command line (continual pretraining / finetuning on a text file):

    python -m eecore.train.layerskip --model PATH --data corpus.txt --steps 1000 --out OUT_DIR
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch

from eecore.extras import require_or_exit
from eecore.train.early_exit_loss import EXIT_CURRICULA, causal_lm_cross_entropy, normalised_exit_scales
from eecore.train.layer_dropout import DROPOUT_CURRICULA, drop_layer, dropout_rates, sample_kept_rows

# Model types whose decoder runs exactly LlamaModel's loop (embed, rotary, causal mask, layers with
# residuals inside, final RMSNorm); others (e.g. Gemma's scaled embeddings) would need their own walk.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class LayerSkipConfig:
    """The recipe's hyperparameters (paper §4.1, summary list).

    p_max: maximum layer-dropout rate (that of the last layer), equation (2). 0 disables dropout.
    e_scale: scale of the earlier layers' exit losses, in [0, 1]. 0 leaves only the last layer's loss.
    dropout_curriculum: S(t), "constant" (finetuning, continual pretraining) or "exp" (from scratch).
    exit_curriculum: C(t, l), "none" (every layer every step), "rotational" or "gradual".
    rotation: R of the rotational curriculum (each layer's exit is on once every R iterations).
    The paper's settings: continual pretraining Llama2 7B p_max=0.1, e_scale=0.2, rotational R=8;
    finetuning on TOPv2 p_max=0.2, e_scale=1.0, gradual."""
    p_max: float = 0.1
    e_scale: float = 0.1
    dropout_curriculum: str = "constant"
    exit_curriculum: str = "rotational"
    rotation: int = 8

    def __post_init__(self):
        if not 0.0 <= self.p_max <= 1.0:
            raise ValueError(f"p_max must be in [0, 1], got {self.p_max}")
        if not 0.0 <= self.e_scale <= 1.0:
            raise ValueError(f"e_scale must be in [0, 1], got {self.e_scale}")
        if self.dropout_curriculum not in DROPOUT_CURRICULA:
            raise ValueError(f"dropout_curriculum must be one of {DROPOUT_CURRICULA}, got {self.dropout_curriculum!r}")
        if self.exit_curriculum not in EXIT_CURRICULA:
            raise ValueError(f"exit_curriculum must be one of {EXIT_CURRICULA}, got {self.exit_curriculum!r}")
        if self.rotation < 1:
            raise ValueError(f"rotation must be >= 1, got {self.rotation}")

    def dropout_rates(self, step: int, total_steps: int, num_layers: int) -> list[float]:
        """p_{l,t} for every layer, equation (2)."""
        return dropout_rates(step, total_steps, num_layers, self.p_max, self.dropout_curriculum)

    def exit_weights(self, step: int, total_steps: int, num_layers: int) -> list[float]:
        """ẽ(t, l) for every layer, equation (6)."""
        return normalised_exit_scales(step, total_steps, num_layers, self.e_scale, self.exit_curriculum,
                                      self.rotation)


@dataclass
class LayerSkipOutput:
    """loss: J(X, Y, t) of equation (5), differentiable.
    layer_losses: J_CE(g(x_{l+1}), Y) for each layer l whose weight ẽ(t, l) is non-zero (part of the
        graph, so `.item()` them for logging; the unembedding of zero-weight exits is skipped).
    exit_weights: ẽ(t, l) per layer. dropout_rates: p_{l,t} per layer.
    rows_run: how many samples of the batch each layer ran on (the rest were dropped)."""
    loss: torch.Tensor
    layer_losses: dict[int, torch.Tensor]
    exit_weights: list[float]
    dropout_rates: list[float]
    rows_run: list[int] = field(default_factory=list)


def _decoder(model):
    """The decoder stack (`model.model`) of a supported `*ForCausalLM`."""
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TypeError(f"model must be a Hugging Face causal LM of type {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
    return model.model


def _layer_masks(config, embeds, attention_mask, position_ids) -> list:
    """The attention mask each decoder layer gets, built the way the model's own forward builds them
    (transformers' masking utils, so every attention implementation gets the form it expects)."""
    import inspect

    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    # no cache: transformers 5.x calls the argument `cache` (`past_key_values` is deprecated there)
    cache_arg = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
    kwargs = {"config": config, "inputs_embeds": embeds, "attention_mask": attention_mask, cache_arg: None,
              "position_ids": position_ids}
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:  # Llama: all full; Mistral: all sliding when it has a window
        sliding = config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None
        layer_types = ["sliding_attention" if sliding else "full_attention"] * num_layers
    builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    masks = {kind: builders[kind](**kwargs) for kind in set(layer_types)}
    return [masks[kind] for kind in layer_types]


def _select_rows(value, rows: Optional[torch.Tensor], batch: int):
    """The kept samples' part of a per-sample layer argument: a tensor whose first dimension is the
    batch is indexed, a broadcast one (first dimension 1) or None passes as is."""
    if rows is None or value is None:
        return value
    if isinstance(value, tuple):
        return tuple(_select_rows(v, rows, batch) for v in value)
    if not isinstance(value, torch.Tensor):
        raise NotImplementedError(f"layer dropout cannot split a {type(value).__name__} attention mask by sample; "
                                  "use the 'sdpa' or 'eager' attention implementation")
    if value.shape[0] == batch:
        return value.index_select(0, rows)
    if value.shape[0] == 1:
        return value
    raise ValueError(f"per-sample layer argument has batch dimension {value.shape[0]}, expected {batch} or 1")


def forward_with_layer_dropout(model, input_ids: torch.Tensor, rates: Sequence[float],
                               generator: Optional[torch.Generator] = None,
                               attention_mask: Optional[torch.Tensor] = None):
    """Run the decoder with per-sample layer dropout, equation (1), layer l dropping each sample with
    probability rates[l]. Returns (hidden_states, kept): hidden_states[l] = x_l for l = 0..L (x_0 the
    embeddings, x_L the last layer's output, none of them final-normed) and kept[l] the bool [B] of
    samples layer l ran on.

    Each decoder layer is called the way the model's own forward calls it, with the attention mask
    and rotary embeddings of the whole batch cut down to the kept samples, so a kept sample's causal
    masking, padding and positions are exactly those of an ordinary forward."""
    decoder = _decoder(model)
    layers = decoder.layers
    if len(rates) != len(layers):
        raise ValueError(f"rates must have one entry per layer ({len(layers)}), got {len(rates)}")
    batch, seq_len = input_ids.shape
    hidden = decoder.embed_tokens(input_ids)
    position_ids = torch.arange(seq_len, device=hidden.device).unsqueeze(0)
    masks = _layer_masks(model.config, hidden, attention_mask, position_ids)
    position_embeddings = decoder.rotary_emb(hidden, position_ids=position_ids)

    hidden_states, kept = [hidden], []
    for layer, p, mask in zip(layers, rates, masks):
        kept_rows = sample_kept_rows(batch, p, generator)

        def run(x, rows, layer=layer, mask=mask):
            return layer(x, attention_mask=_select_rows(mask, rows, batch),
                         position_embeddings=_select_rows(position_embeddings, rows, batch),
                         position_ids=position_ids, use_cache=False)  # the cache argument's default: none

        hidden = drop_layer(run, hidden, kept_rows)
        hidden_states.append(hidden)
        kept.append(kept_rows)
    return hidden_states, kept


def layerskip_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, step: int, total_steps: int,
                   config: LayerSkipConfig, generator: Optional[torch.Generator] = None,
                   attention_mask: Optional[torch.Tensor] = None) -> LayerSkipOutput:
    """The LayerSkip training loss J(X, Y, t) of equation (5) at iteration `step` of `total_steps`.

    model: a Hugging Face Llama-family `*ForCausalLM` (see SUPPORTED_MODEL_TYPES).
    input_ids, labels: [B, S]; labels are unshifted, as for the model's own `labels=` argument
        (position i is scored on labels[i+1]; -100 is ignored). attention_mask: optional [B, S] 0/1.
    generator: the source of the layer-dropout draws; seed it for reproducible training.
    Layer dropout runs whatever the model's train/eval mode: set p_max=0 to evaluate. With p_max=0
    and e_scale=0 the loss is exactly the model's ordinary causal-LM loss."""
    num_layers = model.config.num_hidden_layers
    rates = config.dropout_rates(step, total_steps, num_layers)
    weights = config.exit_weights(step, total_steps, num_layers)
    hidden_states, kept = forward_with_layer_dropout(model, input_ids, rates, generator, attention_mask)

    decoder = _decoder(model)
    lm_head = model.get_output_embeddings()
    loss, layer_losses = None, {}
    for layer, weight in enumerate(weights):
        if weight == 0.0:  # skip the unembedding of disabled exits: the point of the curricula
            continue
        logits = lm_head(decoder.norm(hidden_states[layer + 1]))  # g(x_{l+1}), the model's own head
        layer_loss = causal_lm_cross_entropy(logits, labels)
        layer_losses[layer] = layer_loss
        loss = weight * layer_loss if loss is None else loss + weight * layer_loss
    return LayerSkipOutput(loss=loss, layer_losses=layer_losses, exit_weights=weights, dropout_rates=rates,
                           rows_run=[int(k.sum()) for k in kept])


def train_step(model, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor, labels: torch.Tensor, step: int,
               total_steps: int, config: LayerSkipConfig, generator: Optional[torch.Generator] = None,
               attention_mask: Optional[torch.Tensor] = None, max_grad_norm: Optional[float] = None) -> LayerSkipOutput:
    """One optimizer step on the LayerSkip loss."""
    optimizer.zero_grad(set_to_none=True)
    out = layerskip_loss(model, input_ids, labels, step, total_steps, config, generator, attention_mask)
    out.loss.backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return out


# ---- command line -----------------------------------------------------------------------------


def _batches(token_ids: list[int], seq_len: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless random batches [batch_size, seq_len] of contiguous windows of the token stream."""
    if len(token_ids) < seq_len:
        raise ValueError(f"the data has {len(token_ids)} tokens, fewer than --seq-len {seq_len}")
    stream = torch.tensor(token_ids, dtype=torch.long)
    while True:
        starts = torch.randint(0, len(token_ids) - seq_len + 1, (batch_size,), generator=generator)
        yield torch.stack([stream[s:s + seq_len] for s in starts.tolist()])


def main(argv: Optional[list[str]] = None) -> None:
    require_or_exit(['transformers'], "python -m eecore.train.layerskip")
    parser = argparse.ArgumentParser(prog="python -m eecore.train.layerskip", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model folder (weights + tokenizer)")
    parser.add_argument("--data", required=True, help="a UTF-8 text file to train on")
    parser.add_argument("--out", required=True, help="where to save the trained model and tokenizer")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--p-max", type=float, default=0.1)
    parser.add_argument("--e-scale", type=float, default=0.1)
    parser.add_argument("--dropout-curriculum", choices=DROPOUT_CURRICULA, default="constant")
    parser.add_argument("--exit-curriculum", choices=EXIT_CURRICULA, default="rotational")
    parser.add_argument("--rotation", type=int, default=8, help="R of the rotational curriculum")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = LayerSkipConfig(p_max=args.p_max, e_scale=args.e_scale, dropout_curriculum=args.dropout_curriculum,
                             exit_curriculum=args.exit_curriculum, rotation=args.rotation)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device).train()
    with open(args.data, encoding="utf-8") as f:
        token_ids = tokenizer(f.read())["input_ids"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data_generator = torch.Generator().manual_seed(args.seed)
    dropout_generator = torch.Generator().manual_seed(args.seed + 1)
    batches = _batches(token_ids, args.seq_len, args.batch_size, data_generator)
    for step in range(args.steps):
        input_ids = next(batches).to(args.device)
        out = train_step(model, optimizer, input_ids, input_ids, step, args.steps, config, dropout_generator,
                         max_grad_norm=args.max_grad_norm)
        if step % args.log_every == 0 or step == args.steps - 1:
            per_layer = " ".join(f"{l}:{v.item():.3f}" for l, v in out.layer_losses.items())
            print(f"step {step} loss {out.loss.item():.4f} | layer losses {per_layer}", flush=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)


if __name__ == "__main__":
    main()
