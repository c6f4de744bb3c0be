"""The models that ship with the package: the built-in LlamaGen-style policy (llama.py) and its
transformers export (llama_hf.py), Janus-Pro through transformers (janus.py) and its understanding branch read as
a judge (janus_understanding.py), LlamaGen's released models (llamagen.py; its files, llamagen_load.py; its T5
captions, llamagen_text.py; its VQ tokenizer, llamagen_vq.py), the diffusers VQ tokenizer (tokenizer.py), the
KV cache's writes that the decoders share (kv_cache.py), peft adapters (adapters.py), and the policy kinds that
load and export them (kinds.py).
This file imports nothing: each model's heavy dependencies load only when it is used."""
