"""Train an exit-ready model: LayerSkip's recipe on LoRA pairs of the base, with exit adapters, all
distilled from the original model.

Exit adapters on a frozen base (eecore.train.exit_adapter) stop improving near 0.36-0.46 top-1
agreement on SmolLM2-135M: the early layers' states hold too little of what the last layer will
say. This recipe lets the base change, cheaply enough to ship: LoRA pairs (eecore.models.lora) on
every projection of every layer, trained together with the exit adapters, so the early layers learn
to carry what their exits need while the later layers keep full depth on course.

One step, on a batch of token windows:
- teacher: the original model gives its last-layer logits, without grad: eecore's engine on the
  CPU (the fastest forward there), the student with its LoRA pairs switched off elsewhere (a GPU,
  where it runs in bf16 autocast like the student);
- student: the Hugging Face twin of the same weights with the LoRA pairs (peft), run with
  LayerSkip's per-sample layer dropout (eecore.train.layerskip), gives every layer's state;
- loss = KL(teacher || student's last layer), which keeps full depth close to the original
  (distillation, not the data's next token: the exit-ready model should say what the original says)
  + e_scale * sum over the enabled exits E of KL(teacher || exit E), each exit read through its
  adapter, the final norm and the draft-vocabulary rows of the head, as inference reads it.
  Which exits are enabled at a step follows LayerSkip's exit curricula ("none", "rotational",
  "gradual") over the exit layers.

The result is one adapter file (format 2): the adapter blocks, the draft vocabulary and the LoRA
pairs, which `eecore.LLM(exit_adapter=FILE)` merges into the base weights when it loads them.

Defaults, by measurement on SmolLM2-135M (the model card): the exits' loss weighs 0.3 against the
last layer's (at 1.0 the last layer drifted from the original on 7% of tokens and greedy outputs
fell to ROUGE-L 0.50 against it; at 0.3 to 3% and 0.68), and layer dropout is off (LayerSkip's
p_max = 0.1 put the last layer's KL at 0.53 on the first batch: this 30-layer model cannot do
without its late layers).

Resumable: `<checkpoint_dir>/last.pt` holds the LoRA pairs, the adapters, the optimizer and the
history; the batch and the layer-dropout draws of step t are functions of (seed, t), so a resumed
run ends with the weights of an uninterrupted one.

The command line is eecore.train.exit_ready.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from eecore.models.exit_adapter import AdapterBlock, ExitAdapters, model_fingerprint
from eecore.models.int8_weights import dense
from eecore.models.lora import LLAMA_TARGETS, LoraDeltas
from eecore.train.early_exit_loss import EXIT_CURRICULA, exit_curriculum
from eecore.train.exit_adapter import TeacherPass, distillation_loss, exit_logits, init_block
from eecore.train.layerskip import forward_with_layer_dropout
from eecore.train.layer_dropout import dropout_rates
from eecore.train.loop import check_student_model, restore, run


@dataclass(frozen=True)
class ExitReadyConfig:
    exit_layers: tuple[int, ...] = (8, 12, 16)
    adapter_hidden: int = 1536
    lora_rank: int = 8
    lora_alpha: float = 16.0
    draft_vocab: int = 8192       # K; 0 keeps the full vocabulary
    seq_len: int = 256
    batch_size: int = 4
    steps: int = 1000
    lr: float = 2e-4              # of the LoRA pairs
    adapter_lr: float = 5e-4      # of the exit adapters
    warmup: int = 30
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    p_max: float = 0.0            # LayerSkip's layer dropout (off: see the module doc)
    frozen_layers: int = 0        # the LoRA pairs of layers below this one stay as they start
    e_scale: float = 0.3          # weight of each enabled exit's loss against the last layer's
    # Pairs for separate draft layers (eecore.speculative.draft_stack): the student is layers
    # 0..max(exit_layers)-1 with their pairs, the loss the exits' alone (full depth never runs
    # them, so there is no last layer to hold near the original, and no trade-off).
    draft_only: bool = False
    exit_curriculum: str = "none"
    rotation: int = 2
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.exit_layers or any(not isinstance(E, int) or E < 1 for E in self.exit_layers):
            raise ValueError(f"exit_layers must be a non-empty list of ints >= 1, got {self.exit_layers!r}")
        for name in ("adapter_hidden", "lora_rank", "seq_len", "batch_size", "steps", "rotation"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("lr", "adapter_lr", "temperature", "max_grad_norm", "lora_alpha"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.p_max <= 1.0 or not self.e_scale >= 0.0:
            raise ValueError(f"p_max must be in [0, 1] and e_scale >= 0, got {self.p_max!r}, {self.e_scale!r}")
        if self.exit_curriculum not in EXIT_CURRICULA:
            raise ValueError(f"exit_curriculum must be one of {EXIT_CURRICULA}, got {self.exit_curriculum!r}")
        if self.draft_only and self.p_max:
            raise ValueError("draft_only trains the exits of a copy of the first layers; layer dropout (p_max) "
                             "would drop layers the drafts always run")
        if self.frozen_layers < 0:
            raise ValueError(f"frozen_layers must be >= 0, got {self.frozen_layers!r}")
        if self.draft_vocab < 0 or self.warmup < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError("draft_vocab and warmup must be >= 0, min_lr_ratio in [0, 1]")


def hf_twin(model):
    """A Hugging Face LlamaForCausalLM (fp32) with exactly the weights of eecore's LlamaModel `model`:
    what autograd trains, since eecore's inference ops have no backward."""
    import transformers

    c = model.config
    if c.architecture != "llama" or c.attention_bias:
        raise ValueError(f"exit-ready training supports Llama models, got {c.architecture!r}")
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=False)
    hf = transformers.LlamaForCausalLM(config)
    q_end, k_end = c.num_heads * c.head_dim, (c.num_heads + c.num_kv_heads) * c.head_dim
    state = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.final_norm}
    if not c.tie_word_embeddings:
        state["lm_head.weight"] = model.lm_head
    for i, w in enumerate(model.layers):
        p = f"model.layers.{i}."
        qkv, o_proj, gate_up, down = (dense(t, torch.float32) for t in (w.qkv, w.o_proj, w.gate_up, w.down))
        gate, up = gate_up.chunk(2)
        state.update({p + "input_layernorm.weight": w.input_norm, p + "post_attention_layernorm.weight": w.post_norm,
                      p + "self_attn.q_proj.weight": qkv[:q_end], p + "self_attn.k_proj.weight": qkv[q_end:k_end],
                      p + "self_attn.v_proj.weight": qkv[k_end:], p + "self_attn.o_proj.weight": o_proj,
                      p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": down})
    missing, unexpected = hf.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if unexpected or any(not k.endswith("rotary_emb.inv_freq") for k in missing if k != "lm_head.weight"):
        raise RuntimeError(f"hf_twin: missing {missing}, unexpected {unexpected}")
    if c.tie_word_embeddings:
        hf.tie_weights()
    return hf.float().eval()


def _layer_index(peft_name: str) -> int:
    """The decoder layer a peft LoRA parameter belongs to."""
    return int(_module_path(peft_name)[0].split("layers.")[1].split(".")[0])


def _module_path(peft_name: str) -> tuple[str, str]:
    """("model.layers.3.self_attn.q_proj", "a"|"b") for a peft LoRA parameter name."""
    for which, tag in (("a", ".lora_A."), ("b", ".lora_B.")):
        if tag in peft_name:
            return peft_name.split(tag)[0].removeprefix("base_model.model."), which
    raise ValueError(f"{peft_name!r} is not a LoRA parameter")


class ExitReadyTrainer:
    """The LoRA pairs and exit adapters, their optimizer and schedule, and one training step."""

    def __init__(self, llm, config: ExitReadyConfig, vocab: Optional[torch.Tensor],
                 init_adapters: Optional[ExitAdapters] = None, device: str = "cpu"):
        from peft import LoraConfig, get_peft_model

        model = llm.model
        check_student_model(model, config.exit_layers, "ExitReadyTrainer")
        if config.frozen_layers >= model.num_layers:
            raise ValueError(f"frozen_layers={config.frozen_layers} leaves none of the model's "
                             f"{model.num_layers} layers to train")
        self.llm, self.config, self.vocab, self.device = llm, config, vocab, torch.device(device)
        self.eps = model.eps
        self.head = (model.lm_head if vocab is None else model.lm_head.index_select(0, vocab)).to(self.device)
        # the teacher: eecore's engine where it runs (the CPU), else the student without its pairs
        self.engine_teacher = TeacherPass(llm, (), model.lm_head) if self.device.type == "cpu" else None
        self.autocast = self.device.type == "cuda"  # bf16 matmuls; every loss is taken in fp32
        # draft_only on a GPU: the student lacks the later layers, so the teacher is a twin of its own
        self.teacher_model = hf_twin(model).to(self.device) if config.draft_only and self.engine_teacher is None \
            else None
        twin = hf_twin(model)
        if config.draft_only:
            depth = max(config.exit_layers)
            twin.model.layers = twin.model.layers[:depth]
            twin.config.num_hidden_layers = depth
        self.student_layers = twin.config.num_hidden_layers
        torch.manual_seed(config.seed)  # peft draws the A matrices from torch's global generator
        lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0, bias="none",
                          target_modules=[t.split(".")[-1] for t in LLAMA_TARGETS])
        self.student = get_peft_model(twin, lora).to(self.device)
        self.final_norm = self.student.base_model.model.model.norm.weight
        self.full_head = self.student.base_model.model.lm_head.weight
        g = torch.Generator().manual_seed(config.seed)
        self.blocks = {}
        for E in sorted(config.exit_layers):
            block = init_block(model.config.hidden_size, config.adapter_hidden, g)
            if init_adapters is not None and E in init_adapters.blocks:
                block = AdapterBlock(*(t.float().clone() for t in init_adapters.blocks[E].tensors()))
            self.blocks[E] = AdapterBlock(*(t.to(self.device) for t in block.tensors()))
        # every pair (what checkpoints and exports hold), and those that train
        self.lora_params = {n: p for n, p in self.student.named_parameters() if p.requires_grad}
        if init_adapters is not None and init_adapters.lora is not None:
            self._start_from(init_adapters.lora)
        for name, param in self.lora_params.items():
            param.requires_grad_(_layer_index(name) >= config.frozen_layers)
        self.trained_lora = [p for p in self.lora_params.values() if p.requires_grad]
        self.adapter_params = [t.requires_grad_() for b in self.blocks.values() for t in b.tensors()]
        self.optimizer = torch.optim.AdamW([{"params": self.trained_lora, "lr": config.lr},
                                            {"params": self.adapter_params, "lr": config.adapter_lr}],
                                           weight_decay=0.0)
        self.step = 0
        self.history: list[dict] = []

    def _start_from(self, lora: LoraDeltas) -> None:
        """Sets the pairs to `lora`'s (a file's: a second stage of training starts where one ended).
        A draft_only student takes the pairs of its layers and leaves the file's deeper ones.

        A file of lower rank than this run's starts it too, with the same deltas: its pairs fill the
        first ranks (B rescaled from the file's lora scale to this run's), and the ranks beyond keep
        their random A and a zero B, so they add nothing until they train. That grows a trained
        file's capacity without losing what it learnt (peft itself starts B at zero for this reason)."""
        rank, scale = self.config.lora_rank, self.config.lora_alpha / self.config.lora_rank
        if lora.rank > rank:
            raise ValueError(f"the starting LoRA pairs have rank {lora.rank}, above this run's rank {rank} "
                             f"(--lora-rank): a run may grow a file's rank, not cut it")
        with torch.no_grad():
            for name, param in self.lora_params.items():
                path, which = _module_path(name)
                if path not in lora.pairs:
                    raise ValueError(f"the starting LoRA pairs have none for {path}")
                a, b = (t.float() for t in lora.pairs[path])
                if which == "a":  # [rank, in]: the file's rows first, peft's random ones after
                    param[: lora.rank].copy_(a)
                else:  # [out, rank]: scale * B A == the file's scale * b a
                    param.zero_()
                    param[:, : lora.rank].copy_(b * (lora.scale / scale))

    def lr_factor(self, step: int) -> float:
        c = self.config
        if step < c.warmup:
            return (step + 1) / c.warmup
        progress = (step - c.warmup) / max(1, c.steps - c.warmup)
        return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def enabled_exits(self, step: int) -> list[int]:
        """The exits whose loss counts at `step`: LayerSkip's curriculum over the exit layers."""
        exits = sorted(self.blocks)
        on = exit_curriculum(step, self.config.steps, len(exits) + 1, self.config.exit_curriculum,
                             self.config.rotation)
        return [E for E, enabled in zip(exits, on) if enabled]

    def losses(self, windows: torch.Tensor, step: int, train: bool = True) -> dict:
        """{"final": (KL, agreement), E: (KL, agreement) for each enabled exit}."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self._losses(windows.to(self.device), step, train)

    @torch.no_grad()
    def teacher_logits(self, windows: torch.Tensor) -> torch.Tensor:
        """The original model's last-layer logits `[N, V]` (fp32) of every position of `windows`."""
        if self.engine_teacher is not None:
            return self.engine_teacher(windows.cpu())[1].to(self.device)
        if self.teacher_model is not None:
            return self.teacher_model(windows).logits.float().reshape(-1, self.full_head.shape[0])
        with self.student.disable_adapter():
            return self.student(windows).logits.float().reshape(-1, self.full_head.shape[0])

    def _losses(self, windows: torch.Tensor, step: int, train: bool) -> dict:
        teacher_logits = self.teacher_logits(windows)
        target = teacher_logits.argmax(-1)
        c = self.config
        num_layers = self.student_layers
        rates = dropout_rates(step, c.steps, num_layers, c.p_max, "constant") if train else [0.0] * num_layers
        generator = torch.Generator().manual_seed(c.seed * 1_000_003 + step + 1)
        model = self.student.base_model.model
        states, _ = forward_with_layer_dropout(model, windows, rates, generator)
        d = states[-1].shape[-1]
        out = {}
        if not c.draft_only:  # (a draft-only student has no last layer: it stops at the deepest exit)
            final = (F.rms_norm(states[-1], (d,), self.final_norm, self.eps).reshape(-1, d)
                     @ self.full_head.t()).float()
            out["final"] = (distillation_loss(final, teacher_logits, c.temperature),
                            (final.argmax(-1) == target).float().mean().item())
        vocab = None if self.vocab is None else self.vocab.to(self.device)
        teacher_draft = teacher_logits if vocab is None else teacher_logits[:, vocab]
        if not train:
            exits = sorted(self.blocks)
        elif c.draft_only:
            exits = self.enabled_exits(step) or sorted(self.blocks)  # the exits are all there is to train
        elif c.e_scale:
            exits = self.enabled_exits(step)
        else:
            exits = []  # the exits do not train (evaluation still scores them)
        for E in exits:
            logits = exit_logits(self.blocks[E], states[E].reshape(-1, d), self.final_norm, self.head, self.eps).float()
            picked = logits.argmax(-1) if vocab is None else vocab[logits.argmax(-1)]
            # agreement with the original's token over the full vocabulary, as a draft is judged
            out[E] = (distillation_loss(logits, teacher_draft, c.temperature),
                      (picked == target).float().mean().item())
        return out

    def train_step(self, windows: torch.Tensor) -> dict:
        factor = self.lr_factor(self.step)
        for group, base in zip(self.optimizer.param_groups, (self.config.lr, self.config.adapter_lr)):
            group["lr"] = base * factor
        self.optimizer.zero_grad(set_to_none=True)
        per = self.losses(windows, self.step)
        exits = sum(l for k, (l, _) in per.items() if k != "final")
        total = exits if self.config.draft_only else per["final"][0] + self.config.e_scale * exits
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.trained_lora + self.adapter_params, self.config.max_grad_norm)
        self.optimizer.step()
        record = {"step": self.step, "lr_factor": round(factor, 5),
                  **{f"loss_{k}": round(l.item(), 5) for k, (l, _) in per.items()},
                  **{f"agree_{k}": round(a, 4) for k, (_, a) in per.items()}}
        self.history.append(record)
        self.step += 1
        return record

    @torch.no_grad()
    def evaluate(self, windows: torch.Tensor) -> dict:
        return {str(k): {"loss": round(l.item(), 5), "agreement": round(a, 4)}
                for k, (l, a) in self.losses(windows, self.step, train=False).items()}

    # ---- checkpoints and export -----------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step, "config": dataclasses.asdict(self.config), "history": self.history,
                "lora": {n: p.detach().cpu().clone() for n, p in self.lora_params.items()},
                "blocks": {E: [t.detach().cpu().clone() for t in b.tensors()] for E, b in self.blocks.items()},
                "optimizer": self.optimizer.state_dict(), "vocab": self.vocab,
                "model": model_fingerprint(self.llm.model)}

    def load_state_dict(self, state: dict) -> None:
        restore(self, state)
        with torch.no_grad():
            for name, value in state["lora"].items():
                self.lora_params[name].copy_(value)

    def lora_deltas(self, dtype: torch.dtype = torch.float32) -> LoraDeltas:
        pairs: dict[str, list] = {}
        for name, p in self.lora_params.items():
            path, which = _module_path(name)
            pairs.setdefault(path, [None, None])["ab".index(which)] = p.detach().cpu().to(dtype)
        return LoraDeltas({k: (a, b) for k, (a, b) in pairs.items()}, self.config.lora_alpha / self.config.lora_rank)

    def exit_adapters(self, info: dict, dtype: torch.dtype = torch.float32) -> ExitAdapters:
        blocks = {E: AdapterBlock(*(t.detach().cpu().to(dtype) for t in b.tensors())) for E, b in self.blocks.items()}
        return ExitAdapters(blocks, self.vocab, model_fingerprint(self.llm.model), info, self.lora_deltas(dtype))


def train(llm, tokens: np.ndarray, config: ExitReadyConfig, *, vocab: Optional[torch.Tensor] = None,
          init_adapters: Optional[ExitAdapters] = None, device: str = "cpu", checkpoint_dir: Optional[str] = None,
          checkpoint_every: int = 50, heldout: Optional[np.ndarray] = None, eval_every: int = 0, log=None,
          progress: bool = False, stop_after: Optional[int] = None,
          deadline: Optional[float] = None) -> ExitReadyTrainer:
    """Trains (or resumes) to `config.steps` (eecore.train.loop.run)."""
    return run(ExitReadyTrainer(llm, config, vocab, init_adapters, device), tokens, config, desc="exit-ready",
               checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, heldout=heldout,
               eval_every=eval_every, log=log, progress=progress, stop_after=stop_after, deadline=deadline)
