import time, sys, torch, specter
from specter.offload.runtime import offload_experts
from tests.conftest import prompt
def say(*a): print(*a, flush=True)
for name in ():
    model = specter.load_model(name, device="cuda", dtype=torch.bfloat16)
    for prefetch in (False, True):
        outs = [specter.SpecterEngine(model, specter.SpecterConfig(k=4, resident_experts_per_layer=2, residual_transfer=r, prefetch=prefetch)).generate(prompt(), 32) for r in (False, True)]
        a, b = outs[0].token_ids, outs[1].token_ids
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        say(name, "prefetch", prefetch, "equal", a == b, "first diff", first, "bytes", outs[0].stats["h2d_bytes"], outs[1].stats["h2d_bytes"], "decodes", outs[1].stats["residual_decodes"])
t0 = time.time()
model = specter.load_model("dsv2", weights="synthetic", device="cuda")
say("dsv2 built", round(time.time() - t0, 1), model.dtype)
t0 = time.time(); offload_experts(model, 4); say("offload raw", round(time.time() - t0, 1))
t0 = time.time(); rt = offload_experts(model, 4, residual=True); torch.cuda.synchronize(); say("residual store", round(time.time() - t0, 1), "s, bits/weight", round(rt.residuals.bits_per_weight(), 2))
ids = torch.tensor([model.tokenizer("Natalia sold clips to 48 of her friends in April, and then she sold")["input_ids"][:16]])
for residual in (True, False):
    eng = specter.SpecterEngine(model, specter.SpecterConfig(k=8, resident_experts_per_layer=4, residual_transfer=residual))
    t0 = time.time(); eng.generate(ids, 32); w = time.time() - t0
    out = eng.generate(ids, 128); s = out.stats
    say(f"residual={residual} warm {w:.1f}s TPOT {s['tpot_ms']:.2f} h2d MB/tok {s['h2d_bytes']/s['generated_tokens']/1e6:.0f} decode ms/tok {s['residual_decode_ms']/s['generated_tokens']:.2f} decodes {s['residual_decodes']} gbps {s['h2d_gbps']:.1f} floor {s.get('io_floor_bytes',0)/s['generated_tokens']/1e6:.0f} MB/tok")
