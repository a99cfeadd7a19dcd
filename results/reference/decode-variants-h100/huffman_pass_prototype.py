"""Prototype: sequential per-group Huffman decode of top-bit symbols (one dsv2 expert's groups), on the GPU."""
import heapq, sys, time
import numpy as np, torch, triton, triton.language as tl

PEEK = 12

def lengths_of(counts):
    heap = [(c, s, [s]) for s, c in enumerate(counts) if c]
    L = {s: 0 for _, s, _ in heap}; heapq.heapify(heap)
    while len(heap) > 1:
        (a, t, x), (b, _, y) = heapq.heappop(heap), heapq.heappop(heap)
        for s in x + y: L[s] += 1
        heapq.heappush(heap, (a + b, t, x + y))
    return L

def canonical(L):
    code, prev, out = 0, 0, {}
    for s, n in sorted(L.items(), key=lambda kv: (kv[1], kv[0])):
        code <<= (n - prev); prev = n; out[s] = (code, n); code += 1
    return out

def rev(c, n):
    return int(format(c, f"0{n}b")[::-1], 2)

@triton.jit
def huff_kernel(words, group_word, table, out, groups, GROUP: tl.constexpr, BLOCK: tl.constexpr, PEEKB: tl.constexpr):
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = g < groups
    pos = tl.load(group_word + g, mask=ok, other=0).to(tl.int64) * 32  # bit position
    for j in range(GROUP):
        w = pos >> 5
        sh = (pos & 31).to(tl.uint32)
        w0 = tl.load(words + w, mask=ok, other=0).to(tl.uint32)
        w1 = tl.load(words + w + 1, mask=ok, other=0).to(tl.uint32)
        hi = tl.where(sh == 0, 0, w1 << (32 - sh))
        peek = ((w0 >> sh) | hi) & ((1 << PEEKB) - 1)
        e = tl.load(table + peek.to(tl.int32))
        tl.store(out + g * GROUP + j, (e & 255).to(tl.uint8), mask=ok)
        pos += (e >> 8).to(tl.int64)

def main(device):
    rng = np.random.default_rng(0)
    groups, G = (8_650_752 // 128 if device == "cuda" else 64), 128
    probs = np.exp(-np.abs(np.arange(256) - 128) / 9.0) * (np.abs(np.arange(256) - 128) < 40); probs /= probs.sum()
    sym = rng.choice(256, size=groups * G, p=probs).astype(np.int64)
    L = lengths_of(np.bincount(sym, minlength=256).tolist())
    assert max(L.values()) <= PEEK, max(L.values())
    C = canonical(L)
    code = np.zeros(256, np.int64); ln = np.zeros(256, np.int64)
    table = np.zeros(1 << PEEK, np.int32)
    for s, (c, n) in C.items():
        r = rev(c, n); code[s] = r; ln[s] = n
        table[r + (np.arange(1 << (PEEK - n)) << n)] = s | (n << 8)
    lens = ln[sym].reshape(groups, G)
    gbits = lens.sum(1); gwords = (gbits + 31) // 32
    gstart = np.concatenate([[0], np.cumsum(gwords)[:-1]])
    off = (gstart[:, None] * 32 + np.cumsum(lens, 1) - lens).ravel()
    words = np.zeros(int(gwords.sum()) + 2, np.uint64)
    c = code[sym].astype(np.uint64); wi = off >> 5; sh = (off & 31).astype(np.uint64)
    np.bitwise_or.at(words, wi, (c << sh) & np.uint64(0xffffffff))
    np.bitwise_or.at(words, wi + 1, c >> (np.uint64(32) - sh))
    words32 = torch.from_numpy(words.astype(np.uint32).view(np.int32)).to(device)
    gw = torch.from_numpy(gstart.astype(np.int32)).to(device)
    tab = torch.from_numpy(table).to(device)
    out = torch.empty(groups * G, dtype=torch.uint8, device=device)
    bits_per = gbits.sum() / sym.size
    print(f"mean code bits {bits_per:.3f} (8 fixed), stream MB {words.size*4/1e6:.2f}")
    for block in (32, 64, 128, 256):
        grid = (triton.cdiv(groups, block),)
        huff_kernel[grid](words32, gw, tab, out, groups, GROUP=G, BLOCK=block, PEEKB=PEEK)
        assert torch.equal(out.cpu().long(), torch.from_numpy(sym)), "mismatch"
        if device == "cuda":
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            ts = []
            for _ in range(30):
                s.record(); huff_kernel[grid](words32, gw, tab, out, groups, GROUP=G, BLOCK=block, PEEKB=PEEK); e.record()
                torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
            print(f"BLOCK {block}: huffman pass {sorted(ts)[15]:.4f} ms per dsv2 expert ({groups} groups x {G})")
        else:
            print("ok", block)

if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda")
