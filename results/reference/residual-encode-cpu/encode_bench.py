"""Residual encode of dsv2-shaped experts (gate_up [2816, 2048]) at two commits, side by side in one process (CPU).

    git show 30773f2:specter/quant/residual.py > /tmp/residual_old.py
    python results/reference/residual-encode-cpu/encode_bench.py 2      # experts per encode

Prints each encode's seconds, the ratio, whether words, classes and starts are identical, and the class counts."""
import importlib.util, sys, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from specter.quant import residual as new
from specter.quant.int4 import quantize_rtn, unpack_codes
spec = importlib.util.spec_from_file_location("residual_old", "/tmp/residual_old.py"); old = importlib.util.module_from_spec(spec); sys.modules["residual_old"] = old; spec.loader.exec_module(old)
torch.manual_seed(0)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
for dtype in (torch.bfloat16, torch.float16):
    w = (torch.randn(n, 2 * 1408, 2048) * 0.02).to(dtype)
    w[0, 0, :5] = float("nan")  # a raw group
    d = quantize_rtn(w)
    codes, scales = unpack_codes(d.qweight), d.scales.transpose(-1, -2)
    # wider-margin codes too (GPTQ-like): nudge some codes by one
    codes2 = codes.clone(); flip = torch.rand(codes2.shape) < 0.05
    codes2[flip] = (codes2[flip].int() + 1).clamp(0, 15).to(torch.uint8)
    for label, c in (("rtn", codes), ("nudged", codes2)):
        t = time.perf_counter(); a = old.encode(w, c, scales, 128); t_old = time.perf_counter() - t
        t = time.perf_counter(); b = new.encode(w, c, scales, 128); t_new = time.perf_counter() - t
        same = torch.equal(a.words, b.words) and torch.equal(a.margin_class, b.margin_class) and torch.equal(a.word_start, b.word_start)
        classes = torch.bincount(b.margin_class.flatten().long(), minlength=5).tolist()
        print(f"{str(dtype)[6:]:9s} {label:7s} experts={n} old {t_old:6.2f} s new {t_new:6.2f} s ({t_old / t_new:.2f}x) identical={same} classes={classes}")
