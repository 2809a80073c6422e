# Probe (session 23): per layer and KV head, H = sum over the group's query heads of W_h^T W_h,
# W_h = o_proj[:, h D:(h+1) D] (hidden x D): the output-space weight of a value error e of that
# head is |W_h e|^2 = e^T W_h^T W_h e. Raw float64 [L][Hkv][D][D].
import json, sys, numpy as np
import struct
m = sys.argv[1]; out = sys.argv[2]
c = json.load(open(f"{m}/config.json"))
L, H, Hkv, D = c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
idx = json.load(open(f"{m}/model.safetensors.index.json"))["weight_map"]
cache = {}
def tensor(name):  # a minimal safetensors read (bf16 / f16 / f32)
    path = f"{m}/{idx[name]}"
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
        e = hdr[name]; a, b = e["data_offsets"]
        f.seek(8 + n + a); raw = f.read(b - a)
    if e["dtype"] == "BF16":
        x = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    elif e["dtype"] == "F16":
        x = np.frombuffer(raw, "<f2")
    else:
        x = np.frombuffer(raw, "<f4")
    return x.astype(np.float64).reshape(e["shape"])
res = np.zeros((L, Hkv, D, D))
rep = H // Hkv
for l in range(L):
    w = tensor(f"model.layers.{l}.self_attn.o_proj.weight")  # [hidden, H D]
    for h in range(H):
        wh = w[:, h * D:(h + 1) * D]
        res[l, h // rep] += wh.T @ wh
res.astype("<f8").tofile(out)
print(out, res.shape, [float(np.trace(res[l, 0])) for l in range(L)])
