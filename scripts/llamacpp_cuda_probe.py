"""Where a CUDA build of llama-cpp-python runs: alone in a process, and in one where torch has used CUDA.

    python scripts/llamacpp_cuda_probe.py --out DIR        (GPU machine, llama-cpp-python importable)

Converts tiny-qwen (fp16, on the CPU) to GGUF once, then decodes 8 greedy tokens with every layer on the
GPU in two fresh processes (faulthandler on): `alone` never imports torch; `after-torch` first runs a
CUDA matmul in torch, as the harness's process has. One line per case with its exit status and tokens,
so a crash says which of the two it is.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ("alone", "after-torch")


def make_gguf(out: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    import torch

    import specter
    from baselines.gguf_convert import convert, prepare_checkpoint

    model = specter.load_model("tiny-qwen", device="cpu", dtype=torch.float16)
    return convert(prepare_checkpoint(model, out / "hf"), out / "tiny-qwen-f16.gguf", "f16")


def decode(gguf: str, case: str) -> None:
    """One case, inside its own process."""
    if case == "after-torch":
        import torch

        x = torch.randn(256, 256, device="cuda")
        print("torch", torch.__version__, "CUDA", torch.version.cuda, float((x @ x).sum().cpu()) != 0, flush=True)
    import llama_cpp

    llm = llama_cpp.Llama(gguf, n_ctx=256, n_gpu_layers=-1, seed=0, verbose=False)
    tokens = []
    for token in llm.generate([1, 2, 3, 4], top_k=1, temp=0.0, repeat_penalty=1.0):
        tokens.append(int(token))
        if len(tokens) == 8:
            break
    print("tokens", tokens, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--case", choices=CASES)
    parser.add_argument("--gguf")
    args = parser.parse_args()
    if args.case:
        decode(args.gguf, args.case)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    gguf = make_gguf(args.out)
    for case in CASES:
        done = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--out", str(args.out), "--case", case,
                               "--gguf", str(gguf)], capture_output=True, text=True, timeout=300, check=False)
        (args.out / f"probe-{case}.log").write_text(done.stdout + done.stderr)
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        print(f"{case}: exit {done.returncode}; " + " | ".join(lines[-6:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
