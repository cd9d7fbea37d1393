#!/usr/bin/env python3
"""Checks a hybridgen export against transformers' own Nemotron-H or Qwen3-Next.

    python3 scripts/hf_check.py EXPORT_DIR TOKENS_AND_LOSS.json

EXPORT_DIR is a folder written by `hybridgen export CKPT --to hf EXPORT_DIR
--dtype f32 --loss-check TOKENS_AND_LOSS.json`; the JSON file holds one
sequence of tokens and hybridgen's loss on it (mean cross-entropy of
predicting tokens 1..S from tokens 0..S-1). This script loads the folder
with AutoModelForCausalLM in f32, computes transformers' loss on the same
tokens (labels = input_ids: transformers shifts them itself) and prints
both. It exits 0 when they agree to 1e-4 relative, 1 when they do not, 2 on
bad arguments, 3 when transformers reports a tensor missing, unexpected or
misshapen on load. Needs torch and transformers (a version with the native
`nemotron_h` or `qwen3_next` model); no cargo. Runs on a GPU when one is visible, else on
the CPU; TF32 is switched off so f32 means f32.
"""

import json
import sys

TOLERANCE = 1e-4


def main(argv):
    if len(argv) != 3:
        print("usage: python3 scripts/hf_check.py EXPORT_DIR TOKENS_AND_LOSS.json", file=sys.stderr)
        return 2
    export_dir, loss_path = argv[1], argv[2]
    with open(loss_path) as f:
        expected = json.load(f)
    tokens = expected["tokens"]
    ours = float(expected["loss"])
    if expected.get("dtype", "float32") != "float32":
        print(f"warning: the export is {expected['dtype']}; the 1e-4 check is meant for f32", file=sys.stderr)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The torch path of the Mamba mixer (no fused kernels) and eager
    # attention: the plainest f32 maths transformers has.
    # transformers 5 names the dtype argument `dtype`; 4.x `torch_dtype`.
    major = int(transformers.__version__.split(".")[0])
    kwargs = {"dtype" if major >= 5 else "torch_dtype": torch.float32}
    with open(f"{export_dir}/config.json") as f:
        model_type = json.load(f).get("model_type")
    if model_type == "nemotron_h":
        kwargs["use_mamba_kernels"] = False
    model, info = AutoModelForCausalLM.from_pretrained(
        export_dir,
        attn_implementation="eager",
        output_loading_info=True,
        **kwargs,
    )
    problems = {k: v for k, v in info.items() if k != "error_msgs" and v} | (
        {"error_msgs": info["error_msgs"]} if info.get("error_msgs") else {}
    )
    if problems:
        print(f"transformers did not load every tensor as written: {problems}", file=sys.stderr)
        return 3
    model.to(device).eval()
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, use_cache=False)
    theirs = float(out.loss)
    rel = abs(theirs - ours) / max(abs(ours), 1e-30)
    ok = rel <= TOLERANCE
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}")
    print(f"model: {type(model).__name__}, {sum(p.numel() for p in model.parameters())} parameters, "
          f"{len(tokens)} tokens")
    print(f"hybridgen loss:    {ours!r}")
    print(f"transformers loss: {theirs!r}")
    print(f"relative difference {rel:.3e} ({'within' if ok else 'OVER'} {TOLERANCE:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
