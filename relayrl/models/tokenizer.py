"""Train a small byte-level BPE tokenizer on task text with ``tokenizers``.

Digits are split one per token (arithmetic is learnable digit by digit) and the result is
saved as a standard ``PreTrainedTokenizerFast`` directory that ``AutoTokenizer`` loads.
"""

from __future__ import annotations

from collections.abc import Iterable

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


def train_tokenizer(texts: Iterable[str], vocab_size: int = 384):
    """Train BPE on ``texts``; returns a ``transformers.PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.normalizer = normalizers.NFC()
    # Byte-level: any text round-trips. Digits are split first so each digit is one token.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS, UNK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
