#!/usr/bin/env bash
# The exit-ready training run (python -m eecore.train.exit_ready) on a lent GPU, where a 15-minute
# lease sees ~100x the tokens this project's 2-core CPU can. The device machine has torch, transformers
# and peft but not the model file, gguf or the corpus, and a call uploads at most 64 MiB with the
# repository (~22 MB), so the model (98 MB) and the token stream travel in parts:
#
#   here:    tools/gpu_train_exit_ready.sh pack          # -> .gpu_payload/part{1,2,3,4} (git-ignored)
#   device:  calls back to back (an idle machine goes back after 30 s), each carrying parts that stay
#            in the repo's ignored folder there:
#              carry [".gpu_payload/part1"]                       receive   (also builds eecore: 35 s on an H200)
#              carry [".gpu_payload/part2"]                       receive
#              carry [".gpu_payload/part3", ".gpu_payload/part4"] then the work (61 MiB with the repository
#                                                                 on 2026-11-26; carry part4 in a call of its
#                                                                 own once the repository passes ~25 MB)
#   The work:
#     train MINUTES [ARGS...]   trains within the call (at most 10 minutes; resumable: call it again on the
#                               warm machine to go on) and puts the log and the file (split in 15 MB
#                               pieces: cat exit-ready.safetensors.part* > FILE) into $OUT;
#     start MINUTES [ARGS...]   trains in a process of its own session (setsid), which runs on until the
#                               machine goes back, so that training outlives a call; then (no carry)
#     collect                   waits for it (9 minutes at most: call it again if it says so) and copies
#                               the log and the file into $OUT. Keep a call in flight all along: an idle
#                               machine goes back after 30 s, and the run with it;
#     exitready [ARGS...]       the exit-ready presets on the real weights against full depth on the GPU
#                               (bench/cuda_e2e.py --exit-ready-model), batch 1, 8 and 64; parts 1-3 only;
#     generate PROMPTS [ARGS...] on-policy data: the original model's greedy continuations of PROMPTS code
#                               prompts, or of CODE code prompts and CHAT chat instructions when PROMPTS
#                               is CODE+CHAT, and GENERAL everyday requests when it is CODE+CHAT+GENERAL
#                               (eecore.train.generated_corpus, bf16 on the GPU) into
#                               .gpu_payload/work/gen; no new chunk of 512 prompts starts after 4 minutes
#                               (--stop-after-minutes N after the count changes it), and its manifest says
#                               how many ran. Train on it with `--corpus .gpu_payload/work/gen`;
#     onpolicy BUDGET PROMPTS [ARGS...]  generate, then start the draft layers' training on the data for
#                               what the device time left allows (below), in one call; then collect.
#   ARGS go to the trainer after the defaults (so they win). Add --export-on-stop so that a run its
#   clock stops still writes its file; a second stage on the same machine starts from the first's file
#   (--init-adapters .gpu_payload/work/exit-ready.safetensors) with a --checkpoint-dir of its own.
#
# What ships now (2026-11-26, H200, 557 s of device time in all;
# bench/results/nvidia-h200/h200-draft-layers-onpolicy-train-2026-11-26.json):
# the separate draft layers (pairs of the layers below exit 8 only, trained for the exit alone) on
# on-policy data. The third call ran what `onpolicy BUDGET 20000` now does in one command (BUDGET:
# status's budget_left_s just before the call, less ~15 s for the upload):
#     generate 20000, then
#     start MINUTES --corpus .gpu_payload/work/gen --draft-only --exit-layers 8 \
#       --init-adapters python/eecore/data/smollm2-135m-instruct-draft-layers.safetensors --lora-rank 64 \
#       --lora-alpha 128 --steps 2897 --lr 8e-5 --adapter-lr 1.5e-4 --batch-size 32 --seq-len 512 \
#       --save-dtype int8 --export-on-stop
#     with MINUTES what BUDGET left after generating, less 200 s;
# then `collect`. The 20,000 prompts x 128 tokens took 110 s (the call's generate step 169 s), the
# 2,897 steps of 32 x 512 tokens 284 s (~10 steps/s), and acceptance at d = 1-4 rose 6 points
# (judged with bench/e2e_self_speculation.py on the CPU; docs/draft-layers-history.md has the figures).
# The 200 s leave room for the collect call and the file's way back. Next: the held-out agreement
# was flat over the run's last 600 steps (about 11 passes over the data), so the next run should
# see more of it, and chat as well (the drafts pay on code, not on chat: docs/draft-layers-history.md's section
# "2026-11-26, night" and "fifth session"; "sixth session": on the CPU, twice the code data did not
# keep the code acceptance, so chat and code need the GPU's scale together):
#     onpolicy BUDGET 30000+6800+1300 --recount-draft-vocab --draft-vocab 12288
# (generating stops starting chunks after 4 minutes; the code prompts are every usable function of
# the training packages, evenly picked, so a larger count adds new ones; 6,860 chat instructions
# exist; the 1,300 everyday requests are picked evenly over the topics from their 1,080 templated
# ones and the model's own, about 8 kept of its 16 tries a topic), which trains from the shipped
# file for what is left. Earlier runs: human-written code
# (python -m eecore.sources.corpus, the default --corpus) at rank 32 and 64 on an H100 and an H200 (the
# docs/draft-layers-history.md's sections of 2026-11-24 and 2026-11-26); full-depth LoRA (no --draft-only) on 2026-11-24.
set -euo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
PAYLOAD=.gpu_payload
PY="${PYTHON:-python3}"

pack() {
  local gguf corpus
  gguf="$("$PY" -c "from eecore.models.loader import default_model_path; print(default_model_path())")"
  corpus="$(mktemp -d)"
  "$PY" -m eecore.sources.corpus --out "$corpus" > /dev/null
  # the corpus has a part of its own: with the repository and a third of the model it would pass 64 MiB
  rm -rf "$PAYLOAD" && mkdir -p "$PAYLOAD"/part{1,2,3} "$PAYLOAD"/part4/corpus
  # the token streams, tokenized here (uint16: SmolLM2's ids fit), and the corpus manifest with the
  # tokenizer's fingerprint, which the trainer checks
  "$PY" - "$corpus" "$PAYLOAD/part4/corpus" <<'EOF'
import json, sys
import numpy as np
import eecore
from eecore.train.exit_adapter import tokenize_file, tokenizer_fingerprint
src, dst = sys.argv[1:]
tok = eecore.LLM(max_num_seqs=1).tokenizer
for split in ("train", "heldout"):
    stream = tokenize_file(tok, f"{src}/{split}.txt")
    assert stream.max() < 65536
    np.save(f"{dst}/{split}.npy", stream.astype(np.uint16))
manifest = json.load(open(f"{src}/manifest.json"))
manifest["tokenizer"] = tokenizer_fingerprint(tok)
json.dump(manifest, open(f"{dst}/manifest.json", "w"), indent=1)
EOF
  xz -T0 -6 "$PAYLOAD/part4/corpus/train.npy"
  split -n 3 -d "$gguf" "$PAYLOAD/model.gguf.part"
  mv "$PAYLOAD/model.gguf.part00" "$PAYLOAD/part1/"
  mv "$PAYLOAD/model.gguf.part01" "$PAYLOAD/part2/"
  mv "$PAYLOAD/model.gguf.part02" "$PAYLOAD/part3/"
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$PAYLOAD/part3" \
    "gguf==$("$PY" -c "import importlib.metadata as m; print(m.version('gguf'))")"
  rm -rf "$corpus"
  du -sh "$PAYLOAD"/part*
}

receive() {
  ls -la "$PAYLOAD"/part* 2>/dev/null || { echo "no payload here: carry .gpu_payload/partN"; exit 1; }
  # the first receive call also builds eecore (35 s on an H200), so the later calls' limits go to work
  toolchain
  build "${OUT:-/tmp}"
}

BACKGROUND_OUT=/tmp/eecore-exit-ready  # where a `start`ed run leaves its log and file

# toolchain(): what setup.py needs there to build the CUDA extension
toolchain() {
  export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  if [ -x /usr/bin/g++ ]; then  # see tools/gpu_check.sh: the image's g++ links libstdc++ statically
    export CXX=/usr/bin/g++ LDSHARED="/usr/bin/g++ -shared" LDCXXSHARED="/usr/bin/g++ -shared"
  fi
}

# environment(): the carried gguf wheel, eecore's sources and the toolchain
environment() {
  "$PY" -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "$PAYLOAD"/part3/gguf-*.whl
  export PYTHONPATH="/tmp/site:$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  toolchain
}

build() {
  ls python/eecore/_C*.so > /dev/null 2>&1 || "$PY" setup.py build_ext --inplace > "$1/build.txt" 2>&1 \
    || { tail -30 "$1/build.txt"; exit 1; }
}

start() {
  environment
  mkdir -p "$BACKGROUND_OUT"
  build "$BACKGROUND_OUT"
  rm -f "$BACKGROUND_OUT/exit_code"  # written once the run and its file's split are over
  OUT="$BACKGROUND_OUT" setsid nohup bash -c '"$0" train "$@"; echo $? > "$OUT/exit_code"' "$SELF" "$@" \
    > "$BACKGROUND_OUT/stdout.txt" 2>&1 < /dev/null &
  sleep 60
  tail -c 300 "$PAYLOAD/work/ckpt/train_log.jsonl" 2>/dev/null || tail -20 "$BACKGROUND_OUT/stdout.txt"
}

collect() {
  local waited=0
  while [ ! -f "$BACKGROUND_OUT/exit_code" ] && [ $waited -lt 540 ]; do sleep 5; waited=$((waited + 5)); done
  tail -c 1000 "$BACKGROUND_OUT/stdout.txt"
  if [ -f "$BACKGROUND_OUT/exit_code" ]; then
    echo "the run ended with exit code $(cat "$BACKGROUND_OUT/exit_code") (3: stopped by its clock)"
  else
    echo "still training: collect again"
  fi
  cp "$BACKGROUND_OUT"/* "${OUT:?collect runs on the device machine}/"
}

# assemble_model: the model from the carried parts 1-3, once per machine, into $PAYLOAD/work
assemble_model() {
  local work="$PWD/$PAYLOAD/work"
  mkdir -p "$work"
  for part in 1 2 3; do [ -d "$PAYLOAD/part$part" ] || { echo "missing $PAYLOAD/part$part: carry it first"; exit 1; }; done
  [ -f "$work/model.gguf" ] || cat "$PAYLOAD"/part1/model.gguf.part00 "$PAYLOAD"/part2/model.gguf.part01 \
    "$PAYLOAD"/part3/model.gguf.part02 > "$work/model.gguf"
}

# assemble: the model and the corpus (part 4) from the carried parts, once per machine
assemble() {
  local work="$PWD/$PAYLOAD/work"
  [ -d "$PAYLOAD/part4" ] || { echo "missing $PAYLOAD/part4: carry it first"; exit 1; }
  assemble_model
  mkdir -p "$work/corpus"
  if [ ! -f "$work/corpus/train.npy" ]; then
    cp "$PAYLOAD"/part4/corpus/manifest.json "$PAYLOAD"/part4/corpus/heldout.npy "$work/corpus/"
    xz -dc "$PAYLOAD"/part4/corpus/train.npy.xz > "$work/corpus/train.npy"
  fi
}

# exitready [ARGS...]: the exit-ready presets for a GPU on the real weights against their full depth
# (bench/cuda_e2e.py --exit-ready-model: held-out code prompts, batch 1, 8 and 64, outputs compared);
# needs parts 1-3 only. ARGS go to cuda_e2e.py.
exitready() {
  local out="${OUT:-/tmp}"
  assemble_model
  environment
  build "$out"
  (cd bench && "$PY" cuda_e2e.py --models --exit-models --exit-ready-model "$PWD/../$PAYLOAD/work/model.gguf" \
    --repeats 2 "$@") 2>&1 | grep -v "Writing model shards" | tee "$out/exit-ready-gpu.txt"
  cp bench/results/*/*-e2e-"$(date +%F)".json "$out/" 2>/dev/null || true
}

# generate PROMPTS [ARGS...]: on-policy data, the original model's greedy continuations of PROMPTS code
# prompts made from the machine's installed packages (eecore.train.generated_corpus, in bf16 on the
# GPU), into $PAYLOAD/work/gen; train on it with `start MINUTES --corpus .gpu_payload/work/gen ...`.
# ARGS go to generated_corpus: `--temperatures 0 1` samples every other continuation at temperature 1,
# the contexts sampled requests draft in (docs/exit-ready.md "Sampled requests").
generate() {
  local prompts="${1:?generate PROMPTS [generated_corpus args...]}" work="$PWD/$PAYLOAD/work" code chat general
  shift
  # PROMPTS: CODE, CODE+CHAT for technical chat instructions (eecore.sources.chat_prompts) besides the code
  # prompts, or CODE+CHAT+GENERAL for everyday chat requests too (eecore.sources.general_chat_prompts, 16
  # tries a topic at requests the model writes itself besides the templated ones)
  IFS=+ read -r code chat general <<< "$prompts"
  chat="${chat:-0}" general="${general:-0}"
  assemble
  environment
  build "${OUT:-/tmp}"
  "$PY" -m eecore.train.generated_corpus --out "$work/gen" --model "$work/model.gguf" --device cuda \
    --dtype bfloat16 --max-num-seqs 128 --train-prompts "$code" --heldout-prompts 64 --chat-train-prompts "$chat" \
    --chat-heldout-prompts "$((chat > 0 ? 48 : 0))" --general-train-prompts "$general" \
    --general-heldout-prompts "$((general > 0 ? 48 : 0))" --asked-per-topic "$((general > 0 ? 16 : 0))" \
    --stop-after-minutes 4 "$@"
}

# onpolicy BUDGET PROMPTS [ARGS...]: the run that made the shipped draft file, in one call: generate
# PROMPTS prompts' continuations, then `start` the draft layers' training on them (from the shipped
# file) for what BUDGET leaves, BUDGET being the device seconds left as the call began (status's
# budget_left_s); 200 s stay for `collect` and the file's way back. ARGS go to the trainer last.
onpolicy() {
  local usage="onpolicy BUDGET PROMPTS [trainer args...]"
  local budget="${1:?$usage}" prompts="${2:?$usage}" t0 minutes steps out="${OUT:-/tmp}" gen="$PAYLOAD/work/gen"
  shift 2
  t0=$(date +%s)
  generate "$prompts" > "$out/gen.txt" 2>&1 || { tail -30 "$out/gen.txt"; exit 1; }
  cp "$gen/manifest.json" "$out/gen-manifest.json"
  cp "$gen/heldout.txt" "$out/gen-heldout.txt"  # to evaluate the file on later, here
  minutes=$("$PY" -c "print(round(($budget - ($(date +%s) - $t0) - 200) / 60, 2))")
  steps=$("$PY" -c "print(int($minutes * 60 * 9))")  # the H200 ran 10.2 steps/s, start-up included
  if [ "$steps" -lt 300 ]; then echo "generated, but only $minutes minutes are left to train: not started"; exit 1; fi
  echo "generated in $(( $(date +%s) - t0 )) s; training for $minutes minutes, $steps steps"
  start "$minutes" --corpus "$gen" --draft-only --exit-layers 8 \
    --init-adapters python/eecore/data/smollm2-135m-instruct-draft-layers.safetensors --lora-rank 64 --lora-alpha 128 \
    --steps "$steps" --lr 8e-5 --adapter-lr 1.5e-4 --batch-size 32 --seq-len 512 --save-dtype int8 --export-on-stop "$@"
}

train() {
  local minutes="${1:?train MINUTES [trainer args...]}" out="${OUT:-$BACKGROUND_OUT}" work="$PWD/$PAYLOAD/work"
  shift
  # the log to bring back is the one of this run's checkpoint folder: the last --checkpoint-dir wins
  local ckpt="$work/ckpt" prev=""
  for arg in "$@"; do [ "$prev" = "--checkpoint-dir" ] && ckpt="$arg"; prev="$arg"; done
  mkdir -p "$out"
  assemble
  environment
  build "$out"
  local rc=0
  "$PY" -m eecore.train.exit_ready --model "$work/model.gguf" --corpus "$work/corpus" --checkpoint-dir "$work/ckpt" \
    --out "$work/exit-ready.safetensors" --init-adapters shipped --device cuda --stop-after-minutes "$minutes" "$@" \
    2>&1 | tr '\r' '\n' | grep -v "exit-ready: " | tee "$out/train.txt" || rc=$?
  cp "$ckpt/train_log.jsonl" "$out/" 2>/dev/null || true
  if [ -f "$work/exit-ready.safetensors" ]; then
    split -b 15M -d "$work/exit-ready.safetensors" "$out/exit-ready.safetensors.part"
  fi
  return $rc
}

case "${1:-}" in
  pack) pack ;;
  receive) receive ;;
  train) shift; train "$@" ;;
  start) shift; start "$@" ;;
  generate) shift; generate "$@" ;;
  onpolicy) shift; onpolicy "$@" ;;
  collect) collect ;;
  exitready) shift; exitready "$@" ;;
  *) echo "usage: $0 pack | receive | exitready [cuda_e2e args] | generate PROMPTS [args] | onpolicy BUDGET PROMPTS [trainer args] | train MINUTES [trainer args] | start MINUTES [trainer args] | collect"; exit 2 ;;
esac
