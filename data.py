"""Text to tensors: XLM-R's tokenizer, the XTREME tasks, their files and batches."""
import os

import sentencepiece as spm


class Tokenizer:
    """XLM-R's ids over a sentencepiece model. fairseq's dictionary puts <s>, <pad>, </s>,
    <unk> at 0-3 and lists the pieces after them, so a piece's id is its sentencepiece id + 1
    (sentencepiece's own <unk>, id 0, becomes 3) and <mask> comes last."""
    bos, pad, eos, unk = 0, 1, 2, 3

    def __init__(self, path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f'sentencepiece model {path} not found: pass --spm with XLM-R\'s sentencepiece.bpe.model')
        self.sp = spm.SentencePieceProcessor(model_file=path)
        self.mask = self.sp.get_piece_size() + 1
        self.vocab_size = self.mask + 1

    def _ids(self, spm_ids):
        return [i + 1 if i else self.unk for i in spm_ids]

    def encode(self, text):
        """Ids of `text`, no special tokens."""
        return self._ids(self.sp.encode(text))

    def encode_with_spans(self, text):
        """(ids, spans): spans[i] = (start, end) character offsets of token i in `text`.
        A token that sentencepiece inserted (the leading '▁') has an empty span."""
        out = self.sp.encode_as_offset_mapping(text)
        return self._ids(out['ids']), [tuple(s) for s in out['offsets']]

    def encode_pair(self, a, b=None):
        """<s> a </s> or <s> a </s></s> b </s>, from texts or from lists of ids."""
        a = self.encode(a) if isinstance(a, str) else list(a)
        ids = [self.bos] + a + [self.eos]
        if b is not None:
            ids += [self.eos] + (self.encode(b) if isinstance(b, str) else list(b)) + [self.eos]
        return ids

    def decode(self, ids):
        """Text of ids; special tokens are dropped."""
        return self.sp.decode([0 if i == self.unk else i - 1 for i in ids if self.unk <= i < self.mask])
