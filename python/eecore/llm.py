"""`eecore.LLM` and `eecore.generate`: the public entry points (docs/architecture.md, "The public API")."""
from __future__ import annotations

import atexit
import dataclasses
import inspect
from typing import Iterator, Optional, Sequence, Union

import torch

from eecore import envs
from eecore.device import resolve_device
from eecore.engine.llm_engine import EngineConfig, LLMEngine
from eecore.engine.streaming import DeltaTracker
from eecore.exits.config import EarlyExitConfig
from eecore.outputs import RequestDelta, RequestOutput
from eecore.sampling_params import SamplingParams
from eecore.speculative import SelfSpeculativeConfig

Prompt = Union[str, list[int]]
Prompts = Union[str, Sequence[str], Sequence[list[int]]]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype, device: torch.device, precision: str = "float32") -> torch.dtype:
    """The activations' dtype. "auto" (or None): the checkpoint's own `precision`, fp32 for a
    quantized one (the dtype its values are exact in); on a GPU bf16 in place of fp32 (as vLLM's
    "auto" takes a half type there)."""
    if dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto"):
        own = _DTYPES.get(precision, torch.float32)
        return torch.bfloat16 if device.type == "cuda" and own == torch.float32 else own
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"LLM: 'dtype' must be auto, float32, bfloat16 or float16, got {dtype!r}")


def resolve_quantization(quantization, device: torch.device) -> Optional[str]:
    """None (the checkpoint's own weights), "none" (dequantized), or a GGUF block type's name."""
    from eecore.models.gguf_weights import QUANTIZATIONS

    if quantization is None or quantization == "none":
        return quantization
    if not isinstance(quantization, str) or quantization.lower() not in QUANTIZATIONS:
        raise ValueError(f"LLM: 'quantization' must be None, 'none' or one of {sorted(QUANTIZATIONS)}, "
                         f"got {quantization!r}")
    if device.type != "cpu":
        raise ValueError(f"LLM: quantization={quantization!r} runs on the CPU; on {device.type} the weights "
                         "compute in 'dtype'")
    return QUANTIZATIONS[quantization.lower()]


def _quantize(loaded, type_name: str) -> None:
    from eecore.models.config import ModelConfig
    from eecore.models.gguf_weights import quantize_state_dict

    if loaded.quantized:
        raise ValueError(f"LLM: {loaded.source} is already quantized ({loaded.precision}); 'quantization' "
                         "quantizes a float checkpoint")
    if not isinstance(loaded.config, ModelConfig):
        raise ValueError("LLM: 'quantization' is for decoder-only models")
    quantize_state_dict(loaded.state_dict, type_name)


def runtime_switches(**options) -> dict[str, str]:
    """LLM's run-time options as the values of the environment switches they stand for (only those
    given: None leaves the switch to the environment)."""
    values = {}
    for name, value in options.items():
        if value is None:
            continue
        if name == "gguf_activations":
            if value not in ("exact", "q8"):
                raise ValueError(f"LLM: 'gguf_activations' must be 'exact' or 'q8', got {value!r}")
        elif not isinstance(value, bool):
            raise ValueError(f"LLM: '{name}' must be a bool or None, got {value!r}")
        values[envs.switch_for_option(name).name] = value if isinstance(value, str) else str(int(value))
    return values


class LLM:
    """An early-exit-capable LLM on the paged engine.

    model: None (the embedded SmolLM2-135M-Instruct), a Hugging Face model directory, or a .gguf file.
    dtype: the activations' dtype; "auto": the checkpoint's own (config.json's torch_dtype, a GGUF
        file's float type, fp32 for a quantized GGUF; bf16 in place of fp32 on a GPU).
    quantization: None: the weights as the checkpoint holds them; on the CPU a quantized GGUF file
        computes in its own blocks (ops.linear_gguf), on a GPU it is dequantized at load. "none":
        dequantized to `dtype` everywhere. "int8" (= "q8_0"), "q4_0", "q4_1", "q5_0", "q5_1", "q4_k",
        "q5_k", "q6_k": a float checkpoint's matrices quantized to those GGUF blocks at load (CPU;
        eecore.models.gguf_quantize).
    early_exit / speculative: at most one decoding strategy besides full depth.
    exit_adapter: True (the exit adapters eecore trained for the default model, shipped with it),
        or an adapter file (`python -m eecore.train.exit_adapter`): trained blocks that make the
        exits read like the last layer, and a draft vocabulary. Full depth is unchanged, except
        with an exit-ready file (`python -m eecore.train.exit_ready`), whose LoRA pairs are merged
        into the base weights as they load, or, with
        a draft copy (`LayerDrafts(copy=DraftCopy())`), into the copy of the draft layers alone (full
        depth then stays the original model).
    The keyword-only arguments size the engine (see eecore.engine.llm_engine.EngineConfig);
    `enforce_eager=True` launches every kernel from Python on a GPU instead of replaying CUDA graphs
    of the decode steps, verify passes, draft-copy passes and early-exit segments (vLLM's switch of
    the same name).
    How it runs (each None: the environment's switch, else the default; docs/configuration.md):
    decode_ahead: a decode step launches the next before its tokens are read back (default: on a
        GPU). draft_ahead / verify_ahead: a draft copy's chain on the device, read back once a round,
        and the verify pass launched behind it (default off). fused_rounds: a draft copy's greedy
        rounds with one host round trip, passes back to back from device tokens and acceptance on
        the device (eecore.speculative.fused_round; default off). fused_projections: Llama layers run
        the fused projection ops (default off; changes rounding on a GPU). gguf_activations: "exact"
        (default) or "q8", GGUF projections on the CPU with 8-bit activations (llama.cpp's arithmetic:
        faster, changes outputs). batch_invariant: on a GPU, each row's result independent of the
        rows beside it, so greedy self-speculation equals full depth at any batch (slower; for the
        whole process once on, as cuBLAS's switch it needs is). huge_pages / amx: CPU weights in
        huge pages / tiled for AMX where available (default on).
    tensor_parallel_size: split the model over this many processes (docs/distributed.md): rank 0 is
        this one and starts the others (under torchrun, every rank is torchrun's); a Llama-family
        model whose heads and MLP width the size divides. distributed_timeout_s: how long a rank may
        go without answering before the engine raises TensorParallelError. `shutdown()` (or a `with`
        block) stops the workers; they also stop when the script ends.
    """

    def __init__(self, model: Optional[str] = None, dtype="auto", device=None,
                 early_exit: Optional[EarlyExitConfig] = None,
                 speculative: Optional[SelfSpeculativeConfig] = None,
                 exit_adapter: Union[None, bool, str] = None, *, quantization: Optional[str] = None,
                 block_size: int = 16, num_blocks: Optional[int] = None, kv_cache_memory_fraction: float = 0.3,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 1024, max_model_len: Optional[int] = None,
                 mixed_steps: bool = True, enable_prefix_caching: bool = False, seed: int = 0,
                 enforce_eager: bool = False, decode_ahead: Optional[bool] = None,
                 draft_ahead: Optional[bool] = None, verify_ahead: Optional[bool] = None,
                 fused_rounds: Optional[bool] = None, fused_projections: Optional[bool] = None,
                 gguf_activations: Optional[str] = None, batch_invariant: Optional[bool] = None,
                 huge_pages: Optional[bool] = None, amx: Optional[bool] = None,
                 tensor_parallel_size: int = 1, distributed_timeout_s: float = 60.0):
        options = {k: v for k, v in locals().items() if k != "self"}
        group = None
        if tensor_parallel_size != 1:
            if isinstance(distributed_timeout_s, bool) or not isinstance(distributed_timeout_s, (int, float)) \
                    or not distributed_timeout_s > 0:
                raise ValueError(f"LLM: 'distributed_timeout_s' must be a number > 0, got {distributed_timeout_s!r}")
            group = _torchrun_group(tensor_parallel_size, resolve_device(device), distributed_timeout_s)
            if group is not None and not group.is_leader:  # a torchrun rank > 0: follow rank 0, then end
                from eecore.distributed.launch import serve_as_follower

                serve_as_follower(group, options)
                group.close()
                raise SystemExit(0)
        self._init(options, group)

    @classmethod
    def follower(cls, group, options: dict) -> "LLM":
        """A tensor-parallel rank > 0's LLM: the same options, this rank's slice of the weights
        (eecore.distributed.launch starts it; its engine follows rank 0's)."""
        llm = cls.__new__(cls)
        llm._init(options, group)
        return llm

    def _init(self, options: dict, group) -> None:
        o = dict(options)
        model, dtype, device = o["model"], o["dtype"], o["device"]
        early_exit, speculative, exit_adapter = o["early_exit"], o["speculative"], o["exit_adapter"]
        quantization = o["quantization"]
        envs.check_all()
        switches = runtime_switches(**{k: o[k] for k in _SWITCH_OPTIONS})
        engine_config = EngineConfig(**{k: o[k] for k in _ENGINE_OPTIONS})
        # the options are read where the environment's switches are, while the model and the engine
        # are built (eecore.envs.overridden); decode ahead, read at every step, goes with the engine
        with envs.overridden(switches):
            self._build(model, dtype, device, early_exit, speculative, exit_adapter, quantization, engine_config,
                        o["tensor_parallel_size"], o["distributed_timeout_s"], options, group)

    def _build(self, model, dtype, device, early_exit, speculative, exit_adapter, quantization,
               engine_config: EngineConfig, tp_size: int, tp_timeout_s: float, options: dict, group) -> None:
        from eecore.models.gguf_weights import q8_activations
        from eecore.models.loader import load_model
        from eecore.models.tensor_parallel import check_tensor_parallel

        if early_exit is not None and speculative is not None:
            raise ValueError("LLM: choose either 'early_exit' or 'speculative', not both")
        if early_exit is not None and not isinstance(early_exit, EarlyExitConfig):
            raise TypeError(f"LLM: 'early_exit' must be an EarlyExitConfig, got {type(early_exit).__name__}")
        if speculative is not None and not isinstance(speculative, SelfSpeculativeConfig):
            raise TypeError(f"LLM: 'speculative' must be a SelfSpeculativeConfig, got {type(speculative).__name__}")
        self.device = resolve_device(device)
        quantization = resolve_quantization(quantization, self.device)
        explicit = None if dtype is None or (isinstance(dtype, str) and dtype.lower() == "auto") \
            else resolve_dtype(dtype, self.device)
        loaded = load_model(model, dtype=explicit or "auto",
                            keep_quantized=self.device.type == "cpu" and quantization is None)
        self.dtype = explicit or resolve_dtype("auto", self.device, loaded.precision)
        # what the weights compute in: a GGUF block type's name, or the activations' dtype
        if quantization not in (None, "none"):
            _quantize(loaded, quantization)
            self.weight_format = quantization
        elif loaded.quantized and quantization is None and self.device.type == "cpu":
            self.weight_format = loaded.precision
        else:
            self.weight_format = str(self.dtype).removeprefix("torch.")
        if self.weight_format not in _DTYPES and q8_activations():  # the model will repack its blocks
            self.weight_format += ", 8-bit activations"
        # tensor parallelism: checked against the checkpoint before any worker starts
        check_tensor_parallel(loaded.config, tp_size, loaded.state_dict)
        self.workers = None
        if tp_size > 1 and group is None:  # rank 0 on one machine: spawn the others
            from eecore.distributed.launch import Workers

            self.workers = Workers(tp_size, options, self.device, float(tp_timeout_s))
            group = self.workers.group
        self.tp_group = group
        if group is not None:
            from eecore.distributed.launch import measured_choices

            with envs.overridden(measured_choices(group)):  # rank 0's, on every rank
                self._build_model(loaded, early_exit, speculative, exit_adapter, model, engine_config, group)
            group.counts.clear()  # what the passes send from here on (the build's collectives are not theirs)
        else:
            self._build_model(loaded, early_exit, speculative, exit_adapter, model, engine_config, group)

    def _build_model(self, loaded, early_exit, speculative, exit_adapter, model, engine_config: EngineConfig,
                     group) -> None:
        from eecore.models.build import build_model
        from eecore.models.config import ModelConfig
        from eecore.models.exit_adapter import load_exit_adapters
        from eecore.speculative.draft_stack import build_draft_model

        if group is not None and self.device.type == "cuda":
            # graphs that capture NCCL's collectives have not run on a multi-GPU machine yet: eager until they have
            engine_config = dataclasses.replace(engine_config, enforce_eager=True)
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        separate = speculative is not None and speculative.separate_draft_layers
        if separate and not isinstance(self.config, ModelConfig):
            raise ValueError("LLM: a draft copy (LayerDrafts.copy) is for decoder-only models")
        # before the build: an exit-ready file may carry LoRA pairs to merge into the base weights
        # (or, with separate draft layers, into their copy alone)
        self.exit_adapters = load_exit_adapters(exit_adapter, model, loaded, merge_lora=not separate)
        # the checkpoint is read once more only to build a draft copy
        self.model = build_model(loaded, self.dtype, self.device, consume=not separate, tp=group)
        if self.exit_adapters is not None:
            self.exit_adapters.check_model(self.model)
        draft_model = None
        if separate:
            speculative.validate_for(self.model.num_layers, self.exit_adapters)
            draft_dtype = speculative.layer.copy.dtype
            if draft_dtype == "int8":  # weight-only: the copy's activations keep the model's dtype
                draft_dtype, draft_weights = self.dtype, torch.int8
            else:
                draft_dtype = self.dtype if draft_dtype is None else resolve_dtype(draft_dtype, self.device)
                draft_weights = None
            draft_model = build_draft_model(loaded, speculative.exit_layer, getattr(self.exit_adapters, "lora", None),
                                            draft_dtype, self.device, getattr(self.exit_adapters, "source", ""),
                                            weight_dtype=draft_weights, tp=group)
        del loaded
        strategy, lookahead = _strategy(early_exit, speculative, self.model.num_layers, self.exit_adapters,
                                        self.model, draft_model)
        if group is not None and group.is_leader:
            from eecore.distributed.lockstep import LeaderEngine

            self.engine = LeaderEngine(self.model, self.tokenizer, engine_config, strategy=strategy,
                                       lookahead=lookahead, group=group)
            atexit.register(self.shutdown)  # the workers stop with the script that made them
        else:
            self.engine = LLMEngine(self.model, self.tokenizer, engine_config, strategy=strategy, lookahead=lookahead)

    def shutdown(self) -> None:
        """Stops the tensor-parallel workers (nothing to do on one rank); the LLM generates no more."""
        if getattr(self, "tp_group", None) is None or not self.tp_group.is_leader:
            return
        try:
            self.engine.shutdown()
        finally:
            if self.workers is not None:
                self.workers.terminate()
            self.tp_group.close()
            self.tp_group = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ---- generation ------------------------------------------------------------------------
    def generate(self, prompts: Prompts, sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        seqs = self._add_all(prompts, sampling_params)
        progress = _progress(len(seqs)) if use_tqdm else None
        done = 0
        while self.engine.has_unfinished():
            self.engine.step()
            if progress is not None:
                now = sum(s.is_finished for s in seqs)
                progress.update(now - done)
                done = now
        if progress is not None:
            progress.close()
        return [self.engine.output(s) for s in seqs]

    def generate_stream(self, prompts: Prompts,
                        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None
                        ) -> Iterator[RequestDelta]:
        """Yields each request's new tokens and text as soon as a step produces them (the last
        delta of a request carries its metrics)."""
        self._add_all(prompts, sampling_params)
        tracker = DeltaTracker(self.engine)
        while self.engine.has_unfinished():
            for seq in self.engine.step():
                delta = tracker.delta(seq)
                if delta is not None:
                    yield delta

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them, then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c) for c in conversations]
        outs = self.generate([ids for _, ids in prompts], sampling_params)
        for out, (text, _) in zip(outs, prompts):
            out.prompt = text
        return outs

    def chat_prompt(self, conversation: list[dict]) -> tuple[str, list[int]]:
        """One conversation through the chat template: its text and token ids (Tokenizer.encode_chat)."""
        if self.tokenizer is None:
            raise ValueError("LLM.chat: this model has no tokenizer / chat template")
        # message text stays text (a control token spelled in it is not one); the template already
        # wrote the special tokens, so no second BOS either
        return self.tokenizer.encode_chat(conversation, add_generation_prompt=True)

    # ---- helpers ---------------------------------------------------------------------------
    def _add_all(self, prompts: Prompts, sampling_params):
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("LLM.generate: 'prompts' is empty")
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"LLM.generate: {len(params)} sampling params for {len(prompts)} prompts")
        # Validate every request before any is queued: a bad one fails the call, not the engine.
        encoded = [self.engine.validate(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, params))]
        return [self.engine.enqueue(p, ids, sp, i) for i, (p, ids, sp) in enumerate(zip(prompts, encoded, params))]

_SWITCH_OPTIONS = ("decode_ahead", "draft_ahead", "verify_ahead", "fused_rounds", "fused_projections",
                   "gguf_activations", "batch_invariant", "huge_pages", "amx")
_ENGINE_OPTIONS = ("block_size", "num_blocks", "kv_cache_memory_fraction", "max_num_seqs", "max_num_batched_tokens",
                   "max_model_len", "mixed_steps", "enable_prefix_caching", "seed", "enforce_eager", "decode_ahead")


def _torchrun_group(world_size: int, device: torch.device, timeout_s: float):
    """This process's group when torchrun started it (None otherwise: rank 0 spawns its workers)."""
    from eecore.distributed.group import init_group
    from eecore.distributed.launch import check_devices, rank_device

    world = envs.torchrun_world()
    if world is None:
        return None
    rank, size, local_rank = world
    if size != world_size:
        raise ValueError(f"LLM: tensor_parallel_size={world_size}, but torchrun started {size} processes")
    if device.type == "cuda":
        check_devices(device, local_rank + 1)
    return init_group(rank, size, "env://", timeout_s, rank_device(device, local_rank))


def _strategy(early_exit, speculative, num_layers, adapters, model=None, draft_model=None):
    from eecore.engine.decoding import FullDepthDecoder

    if early_exit is not None:
        from eecore.exits.decoder import EarlyExitDecoder

        early_exit.validate_for(num_layers)
        early_exit.check_model(model, adapters)
        return (lambda runner, sampler: EarlyExitDecoder(runner, sampler, early_exit, adapters)), 1
    if speculative is not None:
        from eecore.speculative import SelfSpeculativeDecoder

        speculative.validate_for(num_layers, adapters)
        return (lambda runner, sampler: SelfSpeculativeDecoder(runner, sampler, speculative, adapters,
                                                               draft_model)), \
            speculative.verify_width
    return FullDepthDecoder, 1


def _progress(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req")


_LLM_OPTIONS = tuple(p for p in inspect.signature(LLM.__init__).parameters if p not in ("self", "model"))


def generate(prompts: Prompts, model: Optional[str] = None, **options) -> list[RequestOutput]:
    """One call: build an LLM from the LLM options, generate with the SamplingParams options.

    >>> eecore.generate("Hello", max_tokens=16, early_exit=eecore.EarlyExitConfig(measure="cosine"))
    """
    llm_kwargs = {k: options.pop(k) for k in list(options) if k in _LLM_OPTIONS}
    sampling_names = SamplingParams.option_names()
    unknown = [k for k in options if k not in sampling_names and k != "sampling_params"]
    if unknown:
        raise TypeError(f"eecore.generate: unknown option(s) {unknown}; LLM options are {list(_LLM_OPTIONS)}, "
                        f"sampling options are {list(sampling_names)}")
    params = options.pop("sampling_params", None)
    if params is not None and options:
        raise TypeError("eecore.generate: pass either 'sampling_params' or individual sampling options, not both")
    if params is None:
        params = SamplingParams(**options)
    return LLM(model, **llm_kwargs).generate(prompts, params)
