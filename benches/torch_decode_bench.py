"""GPT-2 sampling in PyTorch eager with a key/value cache: the peer of `fusec sample --target cuda`.

Decodes the way Hugging Face `generate` does with its dynamic cache: one forward over the
prompt (prefill) that returns each layer's keys and values, then one token at a time, the new
key and value appended to the cache with torch.cat, only the last position's logits computed,
the next token chosen on the GPU and read back (a streaming caller needs it on the host). The
model is GPT-2 (tied embeddings, padded vocabulary) with random weights; only speed is measured.
Prints one JSON line: prefill ms, decode tokens/s (median of --repeats runs).

usage: python3 torch_decode_bench.py --layers 12 --heads 12 --channels 768 --prompt 8 --tokens 200
"""
import argparse, json, math, statistics, time

import torch
import torch.nn.functional as F


class Layer(torch.nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(c), torch.nn.LayerNorm(c)
        self.qkv, self.proj = torch.nn.Linear(c, 3 * c), torch.nn.Linear(c, c)
        self.fc, self.fcproj = torch.nn.Linear(c, 4 * c), torch.nn.Linear(4 * c, c)

    def forward(self, x, cache):
        b, s, c = x.shape
        split = lambda t: t.view(b, s, self.heads, c // self.heads).transpose(1, 2)
        q, k, v = (split(t) for t in self.qkv(self.ln1(x)).split(c, dim=2))
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        # A prefill is causal; a single new query sees every cached key.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=cache is None and s > 1)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, c))
        x = x + self.fcproj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))
        return x, (k, v)


class Gpt2(torch.nn.Module):
    def __init__(self, vocab, max_seq, layers, heads, c):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, c), torch.nn.Embedding(max_seq, c)
        self.layers = torch.nn.ModuleList(Layer(c, heads) for _ in range(layers))
        self.lnf = torch.nn.LayerNorm(c)
        for p in self.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)

    def forward(self, idx, start, caches):
        pos = torch.arange(start, start + idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        new = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, caches[i] if caches else None)
            new.append(kv)
        last = self.lnf(x[:, -1:, :])
        return last @ self.wte.weight.t(), new


@torch.no_grad()
def generate(model, prompt, n):
    """Prefill, then n - 1 one-token steps; returns (tokens, prefill seconds, decode seconds)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    logits, caches = model(prompt, 0, None)
    tok = logits[:, -1, :].argmax(dim=-1, keepdim=True)
    out = [tok.item()]
    t1 = time.perf_counter()
    pos = prompt.shape[1]
    for _ in range(n - 1):
        logits, caches = model(tok, pos, caches)
        tok = logits[:, -1, :].argmax(dim=-1, keepdim=True)
        out.append(tok.item())
        pos += 1
    torch.cuda.synchronize()
    return out, t1 - t0, time.perf_counter() - t1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--channels", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--max-seq", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-tf32", action="store_true")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = not a.no_tf32
    torch.backends.cudnn.allow_tf32 = not a.no_tf32
    torch.manual_seed(0)
    model = Gpt2(a.vocab, a.max_seq, a.layers, a.heads, a.channels).cuda().eval()
    prompt = torch.randint(0, 50257, (1, a.prompt), device="cuda")
    generate(model, prompt, 8)  # warm-up
    runs = [generate(model, prompt, a.tokens) for _ in range(a.repeats)]
    decode = [(a.tokens - 1) / d for _, _, d in runs]
    print(json.dumps({
        "mode": "torch-eager-kv-cache" + ("" if a.no_tf32 else "-tf32"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "prefill_ms_median": round(1e3 * statistics.median(p for _, p, _ in runs), 2),
        "decode_tokens_per_s_median": round(statistics.median(decode), 1),
        "decode_tokens_per_s_all": [round(x, 1) for x in decode],
    }))


if __name__ == "__main__":
    main()
