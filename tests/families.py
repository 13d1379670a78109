"""Tiny models of the families researchers use, each saved with a tokenizer built locally in its family's style
(byte-level BPE, Metaspace BPE with a BOS, WordPiece), special-token conventions (pad == eos or none, BOS == EOS) and
chat template (the BOS written as text, text after the end-of-turn token), loaded by path through transformers."""

import common

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}"
    "\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
LLAMA2 = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)
PHI3 = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# name: (tokenizer style, special tokens, BOS added by the post-processor, chat template, config, extra specials)
FAMILIES = {
    "llama": ("metaspace", dict(bos="<s>", eos="</s>", unk="<unk>"), True, LLAMA2, "LlamaConfig", []),
    "llama3": (
        "bytelevel",
        dict(bos="<|begin_of_text|>", eos="<|eot_id|>"),
        True,
        LLAMA3,
        "LlamaConfig",
        ["<|start_header_id|>", "<|end_header_id|>"],
    ),
    "qwen2": ("bytelevel", dict(eos="<|im_end|>", pad="<|endoftext|>"), False, CHATML, "Qwen2Config", ["<|im_start|>"]),
    "mistral": ("metaspace", dict(bos="<s>", eos="</s>", unk="<unk>"), True, LLAMA2, "MistralConfig", []),
    "gemma2": (
        "metaspace",
        dict(bos="<bos>", eos="<end_of_turn>", pad="<pad>", unk="<unk>"),
        True,
        GEMMA,
        "Gemma2Config",
        ["<start_of_turn>"],
    ),
    "gemma3": (
        "metaspace",
        dict(bos="<bos>", eos="<end_of_turn>", pad="<pad>", unk="<unk>"),
        True,
        GEMMA,
        "Gemma3TextConfig",
        ["<start_of_turn>"],
    ),
    "gpt2": ("bytelevel", dict(bos="<|endoftext|>", eos="<|endoftext|>"), False, None, "GPT2Config", []),
    "neox": ("bytelevel", dict(bos="<|endoftext|>", eos="<|endoftext|>"), False, None, "GPTNeoXConfig", []),
    "opt": ("bytelevel", dict(bos="</s>", eos="</s>", pad="<pad>"), True, None, "OPTConfig", []),
    "bloom": ("bytelevel", dict(bos="<s>", eos="</s>", pad="<pad>"), False, None, "BloomConfig", []),
    "phi3": (
        "metaspace",
        dict(bos="<s>", eos="<|end|>", unk="<unk>"),
        True,
        PHI3,
        "Phi3Config",
        ["<|user|>", "<|assistant|>", "<|system|>"],
    ),
    "bert": (
        "wordpiece",
        dict(cls="[CLS]", sep="[SEP]", pad="[PAD]", unk="[UNK]", mask="[MASK]"),
        None,
        None,
        "BertConfig",
        [],
    ),
    "roberta": (
        "bytelevel",
        dict(bos="<s>", eos="</s>", cls="<s>", sep="</s>", pad="<pad>", unk="<unk>"),
        None,
        None,
        "RobertaConfig",
        [],
    ),
    "deberta": (
        "metaspace",
        dict(bos="[CLS]", eos="[SEP]", cls="[CLS]", sep="[SEP]", pad="[PAD]", unk="[UNK]"),
        None,
        None,
        "DebertaV2Config",
        [],
    ),
}
DECODERS = [f for f in FAMILIES if f not in ("bert", "roberta", "deberta")]
ENCODERS = ["bert", "roberta", "deberta"]
TEMPLATED = [f for f, spec in FAMILIES.items() if spec[3] is not None]
WINDOWED = ["mistral", "phi3", "qwen2", "gemma2", "gemma3"]
WINDOW = 8
# Stored as hub checkpoints are: bfloat16 (Llama 3, Qwen 2.5, Gemma, Mistral), float16 (Pythia), float32 (GPT-2, BERT).
STORED_DTYPE = {"neox": "float16", "gpt2": "float32", "bert": "float32"}


def corpus():
    import random

    rng = random.Random(0)
    lines = [common.embedded_prompt(rng) + common.embedded_response(rng) for _ in range(400)]
    return (
        lines
        + [
            "tell me about the weather today, please.",
            "Hello! How are you? I am fine, thanks.",
            "user assistant system model",
        ]
        * 5
    )


def build_tokenizer(family):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    style, special, add_bos, template, _, extra = FAMILIES[family]
    names = list(dict.fromkeys(v for k, v in special.items())) + extra
    if style == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token=special["unk"]))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=names)
    elif style == "metaspace":
        tok = Tokenizer(models.BPE(unk_token=special.get("unk")))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=names, initial_alphabet=list("▁\n"))
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400, special_tokens=names, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
    tok.train_from_iterator(corpus(), trainer)
    ids = {n: tok.token_to_id(n) for n in names}
    if add_bos is None:  # encoders: [CLS] text [SEP]
        cls, sep = special["cls"], special["sep"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B {sep}", special_tokens=[(cls, ids[cls]), (sep, ids[sep])]
        )
    elif add_bos:
        bos = special["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids[bos])]
        )
    elif style == "bytelevel":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    kwargs = {f"{k}_token": v for k, v in special.items()}
    out = PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=extra, **kwargs)
    out.chat_template = template
    return out


def build_config(family, tokenizer):
    import transformers

    _, _, _, _, config_name, _ = FAMILIES[family]
    vocab = len(tokenizer)
    ids = dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    small = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **ids)
    dropout = 0.1  # on, as in the released configs: the scripts must turn all of it off
    cls = getattr(transformers, config_name)
    if family in ("gpt2",):
        return cls(
            vocab_size=vocab,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=256,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            **ids,
        )
    if family == "bloom":
        return cls(
            vocab_size=vocab,
            hidden_size=32,
            n_layer=2,
            n_head=4,
            hidden_dropout=dropout,
            attention_dropout=dropout,
            **ids,
        )
    if family == "opt":
        return cls(
            ffn_dim=64,
            word_embed_proj_dim=32,
            max_position_embeddings=256,
            dropout=dropout,
            attention_dropout=dropout,
            **small,
        )
    if family in ENCODERS:
        return cls(
            intermediate_size=64,
            max_position_embeddings=256,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            **small,
        )
    if family == "neox":
        return cls(
            intermediate_size=64,
            max_position_embeddings=256,
            hidden_dropout=dropout,
            attention_dropout=dropout,
            **small,
        )
    # Sliding windows shorter than the tests' sequences (12-60 tokens), as real ones are shorter than real contexts:
    # Mistral and Phi-3 on every layer, Qwen2 from max_window_layers on, Gemma 2 and 3 alternating local and global.
    extra = {
        "mistral": dict(sliding_window=WINDOW),
        "phi3": dict(sliding_window=WINDOW),
        "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        "gemma2": dict(head_dim=8, sliding_window=WINDOW),
        "gemma3": dict(head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
    }.get(family, {})
    return cls(
        intermediate_size=64,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attention_dropout=dropout,
        tie_word_embeddings=False,
        **extra,
        **small,
    )


def save_family(family, path, seed=0):
    """A tiny random causal LM (decoders) or sequence classifier (encoders) and its tokenizer, saved at path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    tokenizer = build_tokenizer(family)
    config = build_config(family, tokenizer)
    torch.manual_seed(seed)
    if family in ENCODERS:
        config.num_labels = 1
        model = AutoModelForSequenceClassification.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    model.to(getattr(torch, STORED_DTYPE.get(family, "bfloat16"))).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
