"""One rank of test_tensor_parallel.py (run by torch.distributed.run over gloo): loads the saved
model with transformers' tp_plan="auto", generates greedily with a veloxquant.Cache per spec and
saves this rank's tokens, per-step logits and the KV heads its cache holds."""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

import veloxquant
from conftest import kv

model_dir, out_dir, specs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
rank = int(os.environ["RANK"])
model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32,
                                             attn_implementation="veloxquant").eval()
model.generation_config.eos_token_id = None
prompt = torch.load(os.path.join(out_dir, "prompt.pt"))
result = {}
for spec in specs:
    cache = veloxquant.Cache(spec, model_config=model.config)
    out = model.generate(prompt, **kv(cache), max_new_tokens=8, do_sample=False, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    result[spec] = {"tokens": out.sequences[0].tolist(),
                    "scores": torch.stack(out.scores).flatten().tolist(),
                    "kv_heads": [layer._cache.n_kv_heads for layer in cache.layers],
                    "kv_head_range": list(cache.kv_heads)}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
    json.dump(result, f)
