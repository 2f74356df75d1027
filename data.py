"""Text to tensors: XLM-R's tokenizer, the XTREME tasks, their files and batches."""
import os
from dataclasses import dataclass

import sentencepiece as spm


@dataclass(frozen=True)
class Task:
    name: str
    family: str  # classification | tagging | qa | retrieval (also the leaderboard's group)
    metric: str  # accuracy | f1 | em_f1 (QA: the mean of exact match and F1)
    langs: tuple  # XTREME's languages, in the leaderboard's order (its averages sum in this order)
    labels: tuple = ()


UPOS = tuple('ADJ ADP ADV AUX CCONJ DET INTJ NOUN NUM PART PRON PROPN PUNCT SCONJ SYM VERB X'.split())
TASKS = {t.name: t for t in [  # the leaderboard's task order
    Task('pawsx', 'classification', 'accuracy', tuple('de en es fr ja ko zh'.split()), ('0', '1')),
    Task('xnli', 'classification', 'accuracy', tuple('ar bg de el en es fr hi ru sw th tr ur vi zh'.split()),
         ('contradiction', 'entailment', 'neutral')),
    Task('panx', 'tagging', 'f1', tuple('ar he vi id jv ms tl eu ml ta te af nl en de el bn hi mr ur fa fr it pt es '
                                        'bg ru ja ka ko th sw yo my zh kk tr et fi hu'.split()),
         ('O', 'B-PER', 'I-PER', 'B-ORG', 'I-ORG', 'B-LOC', 'I-LOC')),
    Task('udpos', 'tagging', 'f1', tuple('af ar bg de el en es et eu fa fi fr he hi hu id it ja kk ko mr nl pt ru ta '
                                         'te th tl tr ur vi yo zh'.split()), UPOS),
    Task('bucc2018', 'retrieval', 'f1', tuple('de fr ru zh'.split())),
    Task('tatoeba', 'retrieval', 'accuracy', tuple('ar he vi id jv tl eu ml ta te af nl de el bn hi mr ur fa fr it '
                                                   'pt es bg ru ja ka ko th sw zh kk tr et fi hu'.split())),
    Task('xquad', 'qa', 'em_f1', tuple('en es de el ru tr ar vi th zh hi'.split())),
    Task('mlqa', 'qa', 'em_f1', tuple('en es de ar hi vi zh'.split())),
    Task('tydiqa', 'qa', 'em_f1', tuple('en ar bn fi id ko ru sw te'.split())),
]}
GROUPS = {'classification': ('pawsx', 'xnli'), 'tagging': ('udpos', 'panx'),
          'qa': ('xquad', 'mlqa', 'tydiqa'), 'retrieval': ('bucc2018', 'tatoeba')}


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
