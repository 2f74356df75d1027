"""The tokenizer gives XLM-R's ids: checked against fairseq's own route (sentencepiece pieces
looked up in a dictionary built the way fairseq builds dict.txt) and against Hugging Face's
XLM-R tokenizer where the transformers test extra is installed."""
import pytest
import sentencepiece as spm

from conftest import SCRIPTS
from data import Tokenizer

TEXTS = list(SCRIPTS.items()) + [('unseen', 'Ωmega ÆØÅ 12345 ﬁne   spaces ✓')]


def fairseq_ids(spm_path, text):
    """fairseq: <s> <pad> </s> <unk>, then every piece of the model after its three specials,
    in order; text -> pieces -> dictionary lookup, unknown pieces -> <unk>."""
    sp = spm.SentencePieceProcessor(model_file=spm_path)
    symbols = ['<s>', '<pad>', '</s>', '<unk>'] + [sp.id_to_piece(i) for i in range(3, sp.get_piece_size())]
    index = {s: i for i, s in enumerate(symbols)}
    return [index.get(p, 3) for p in sp.encode(text, out_type=str)]


@pytest.mark.parametrize('name,text', TEXTS)
def test_single_texts_match_fairseq(spm_path, name, text):
    tok = Tokenizer(spm_path)
    ids = fairseq_ids(spm_path, text)
    assert tok.encode(text) == ids
    assert tok.encode_pair(text) == [0] + ids + [2]


def test_pairs_and_special_ids(spm_path):
    tok = Tokenizer(spm_path)
    a, b = SCRIPTS['latin'], SCRIPTS['thai']
    assert tok.encode_pair(a, b) == [0] + fairseq_ids(spm_path, a) + [2, 2] + fairseq_ids(spm_path, b) + [2]
    pieces = spm.SentencePieceProcessor(model_file=spm_path).get_piece_size()
    assert (tok.mask, tok.vocab_size) == (pieces + 1, pieces + 2)
    assert 3 in tok.encode('✓')  # a character the model never saw is <unk>


@pytest.mark.parametrize('name,text', TEXTS)
def test_same_ids_as_huggingface(spm_path, name, text):
    transformers = pytest.importorskip('transformers')
    pytest.importorskip('google.protobuf')  # HF converts the sentencepiece model through protobuf
    import os
    ref = transformers.XLMRobertaTokenizer.from_pretrained(os.path.dirname(spm_path))
    tok = Tokenizer(spm_path)
    assert tok.encode_pair(text) == ref(text)['input_ids']
    assert tok.encode_pair(text, SCRIPTS['chinese']) == ref(text, SCRIPTS['chinese'])['input_ids']
    assert tok.mask == ref.mask_token_id


def test_qa_case_lower_lowers_one_character_at_a_time(spm_path):
    """--qa_case lower reads QA text as XTREME's and FILTER's scripts made XLM-R's tokenizer read it with
    do_lower_case: transformers 2.x's tokenize lowered the text one character at a time (a final Σ becomes σ), then
    sentencepiece; transformers 5 has no such step, so its tokenizer is given the text lowered so by hand."""
    transformers = pytest.importorskip('transformers')
    pytest.importorskip('google.protobuf')
    import os
    ref = transformers.XLMRobertaTokenizer.from_pretrained(os.path.dirname(spm_path))
    text = 'ΚΑΝΕΙΣ ΚΟΣΜΟΣ, ΣΗΜΕΡΑ Σ'
    by_hand = ''.join(c.lower() for c in text)
    assert by_hand != text.lower() and 'ς' in text.lower()
    tok = Tokenizer(spm_path, lower=True)
    assert tok.encode(text) == ref.encode(by_hand, add_special_tokens=False)
    assert tok.encode(text) != ref.encode(text.lower(), add_special_tokens=False)  # the whole text at once differs
    ids, spans = tok.encode_with_spans(text)
    assert ids == tok.encode(text) and spans[-1][1] == len(text)
    cased = Tokenizer(spm_path)  # a cased run reads a capital sigma as it is
    assert cased.model_text(text) == text and cased.encode(text) == ref.encode(text, add_special_tokens=False)


@pytest.mark.parametrize('name,text', TEXTS)
def test_spans_point_back_into_the_text(spm_path, name, text):
    tok = Tokenizer(spm_path)
    sp = spm.SentencePieceProcessor(model_file=spm_path)
    ids, spans = tok.encode_with_spans(text)
    assert ids == tok.encode(text) and len(spans) == len(ids)
    assert all(0 <= s <= e <= len(text) for s, e in spans)
    assert [s for s, e in spans] == sorted(s for s, e in spans)
    # every character that is not a space lies in exactly one token's span
    covered = sorted(i for s, e in spans for i in range(s, e) if not text[i].isspace())
    assert covered == [i for i, c in enumerate(text) if not c.isspace()]
    # where normalisation leaves the text alone, a span's text is the piece itself
    for i, (s, e) in zip(ids, spans):
        piece = sp.id_to_piece(i - 1).replace('▁', '') if i != 3 else None
        if piece and s < e and text[s:e].strip() == sp.normalize(text[s:e]).replace('▁', ''):
            assert text[s:e].strip() == piece


@pytest.mark.parametrize('name,text', TEXTS[:-1])
def test_decode_round_trip(spm_path, name, text):
    tok = Tokenizer(spm_path)
    assert tok.decode(tok.encode_pair(text)) == spm.SentencePieceProcessor(model_file=spm_path).normalize(text).replace('▁', ' ').strip()


def test_missing_model_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match='pass --spm'):
        Tokenizer(str(tmp_path / 'nope.model'))
