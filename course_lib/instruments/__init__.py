"""Instruments: tools that measure a model rather than lessons that build one. They import the
model library; the model library never imports them, and neither do they import the course
machinery in ``course_lib.course``.

    probes         black-box tests of which outputs depend on which inputs (future leaks),
                   head ablation, per-layer gradient norms, head roles, previous-token
                   and induction scores, a head's path into one later layer, logit lens
    induction      chapter 11's recipe: an attention-only model trained on repeated
                   segments, its training log, the loss on each half
    divergence     the first submodule where two implementations of one network disagree
    gym            chapter 11's debugging gym: planted bugs and the measurements that find them
    measure        the attention kernel a call reached (kernel_used), peak tensor memory
    tokens         chapter 13's tokens in colour (show_tokens, token_widget), bits per
                   character, one decoder trained on a vocabulary at equal compute
    viz            attention heatmaps, a real model's head view, the plot style, widgets
    hf_bpe         Hugging Face tokenizers' byte-level BPE set up as bpe.train_bpe, to compare
    bert_app       load_pretrained_encoder: the bundled all-MiniLM-L6-v2 with its
                   tokenizer, encode(...), sentence embeddings, semantic search
"""
