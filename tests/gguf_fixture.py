"""A tiny Llama chat model written as a GGUF file, the way llama.cpp's `convert_hf_to_gguf.py` writes one.

The real `model=smollm2_135m` GGUF (98 MB, from the package index) is out of reach in CI, so the tests
build a small model of the same family locally: a byte-level BPE tokenizer trained on arithmetic
questions (SmolLM2's special tokens and ChatML template), a seeded `LlamaForCausalLM` with tied
embeddings, and a GGUF holding both under llama.cpp's metadata keys and tensor names, its q/k rows
permuted as llama.cpp does (transformers' loader undoes that).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

GGUF_NAME = "tiny-llama.gguf"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (SmolLM2's)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VOCAB_SIZE = 400
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, CONTEXT = (
    128,
    2,
    2,
    1,
    256,
    256,
)  # head_dim 64: vLLM CPU kernels take it
HEAD_DIM = HIDDEN // HEADS


def corpus() -> list[str]:
    """Arithmetic questions and answers, chat-formatted and plain (a few hundred words)."""
    lines = []
    for i in range(40):
        a, b = (7 * i + 3) % 50, (11 * i + 5) % 40
        op, value = [("+", a + b), ("-", a - b), ("*", a * b)][i % 3]
        question = f"What is {a} {op} {b}? Answer with just the number."
        lines.append(question)
        lines.append(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{value}<|im_end|>\n")
        lines.append(f"The answer to {a} {op} {b} is {value}.")
    return lines


def build_tokenizer():
    """A byte-level BPE tokenizer (GPT-2's pre-tokenization, as SmolLM2's) wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus(), trainer=trainer)
    assert [backend.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_model(vocab_size: int):
    """A seeded tiny Llama; weights large enough that attention is not uniform (so a q/k layout error
    shows in the logits), and norms away from 1 (so a norm mix-up shows too)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.1,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
    return model.eval()


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (rotary halves interleaved per head)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """The state dict under llama.cpp's names (float32, q/k permuted; no output.weight when tied)."""
    state = {k: v.detach().to(torch.float32).numpy() for k, v in model.state_dict().items()}
    cfg = model.config
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"]}
    names = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for i in range(cfg.num_hidden_layers):
        for gguf_name, hf_name in names.items():
            w = state[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif gguf_name == "attn_k":
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
            tensors[f"blk.{i}.{gguf_name}.weight"] = w
    tensors["output_norm.weight"] = state["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    return tensors


def can_quantize_q8_0() -> bool:
    try:
        import gguf

        gguf.quants.quantize(np.zeros((1, 32), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    except Exception:
        return False
    return True


def write_gguf(path: Path, model, tokenizer, *, quantize: bool = False) -> Path:
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_vocab_size(cfg.vocab_size)
    file_type = gguf.LlamaFileType.MOSTLY_Q8_0 if quantize else gguf.LlamaFileType.ALL_F32
    writer.add_file_type(file_type)

    # the tokenizer as llama.cpp's `_set_vocab_gpt2` writes it: byte-level spellings, merges "a b"
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    assert None not in tokens and len(tokens) == len(tokenizer) == cfg.vocab_size
    special = set(tokenizer.all_special_tokens)
    token_types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)

    for name, data in gguf_tensors(model).items():
        if quantize and data.ndim == 2:
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_llama_gguf(directory: Path, *, quantize: bool = False):
    """(`directory/tiny-llama.gguf`, the HF model it holds (eval mode), the HF tokenizer). With
    `quantize`, the weight matrices are stored as Q8_0 (norms stay F32), as a `--outtype q8_0` file."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer))
    path = write_gguf(directory / GGUF_NAME, model, tokenizer, quantize=quantize)
    return path, model, tokenizer
