"""The second backbone: BERT's WordPiece tokenizer against transformers' Python BertTokenizer (the one
XTREME's scripts used), BERT's encoder, pooler and task heads against transformers' BertModel and
BertFor* classes, its checkpoint layouts, and an mBERT-sized run from a random folder in the real
layout."""
import json
import os
import re

import pytest
import torch

import data
import layers
import xlt
from conftest import SCRIPTS, bert_config, demo_run, one_line, random_bert_weights, write_bert_vocab, write_hf_dir

# accents, CJK, Thai, Arabic, Devanagari, control characters, emoji, a word of over 100 characters, punctuation runs
HARD = {
    'accents': 'Héllo, Wörld! Ça va? Ñandú; ÀÉÎÕÜ ǅemal',
    'sigma': 'ΟΔΟΣ. ΟΔΟΣ.Α Σίσυφος',
    'mixed cjk': 'Tokyo東京都and北京，中文text混合',
    'controls': 'ctrl\x00char\x07s\u200b here\tand\nnew\rline \ufffd x\x0by',
    'emoji': 'emoji 😀👍🏽 ok ✓',
    'long word': 'a' * 101 + ' ' + 'b' * 100 + ' short',
    'punctuation': 'wait!!!...???---(([[{{ }}]])) U.S.A. 3.14 $5 €5 ½ don\'t',
    'spaces': 'Zl\u2028sep\u2029x\u00a0nbsp\u3000ideo  İstanbul ß',
    'korean': '한국어 텍스트 입니다',
    'greek capitals': 'ΑΘΗΝΑΣ ΟΔΟΣ. Η ΟΔΟΣ ΣΤΗΝ ΑΘΗΝΑ [SEP] [MASK]',
}
GREEK = 'αθηνας αθηνασ οδος οδοσ δ'  # both sigmas at a word's end, so that the vocabulary tells them apart
TEXTS = {**SCRIPTS, **HARD}


@pytest.fixture(scope='module')
def vocab(tmp_path_factory):
    return write_bert_vocab(tmp_path_factory.mktemp('vocab'), list(SCRIPTS.values()) + ['Hello World wide Istanbul',
                                                                                         GREEK])


def lowered_as_transformers_4(text, specials=('[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]')):
    """What transformers 2.x's and 4.x's PreTrainedTokenizer.tokenize did under do_lower_case before the tokenizer
    ran: the text outside the special tokens lowered one character at a time (so a final Σ becomes σ; str.lower of a
    whole word gives ς). transformers 5 dropped the step, so its Python BertTokenizerLegacy is given the text so."""
    pattern = '(' + '|'.join(re.escape(s) for s in specials) + ')|(.)'
    return re.sub(pattern, lambda m: m.group(1) or m.group(2).lower(), text, flags=re.DOTALL)


@pytest.mark.parametrize('lower', [False, True], ids=['cased', 'lowercased'])
def test_wordpiece_gives_bert_tokenizers_ids(vocab, lower):
    """transformers 5's Python BertTokenizer (BertTokenizerLegacy: XTREME's transformers 2.x had it as
    BertTokenizer) adds an NFC normalisation that 2.x had not: every text here is NFC already. The
    Rust BertTokenizer gives the same ids on them."""
    legacy = pytest.importorskip('transformers.models.bert.tokenization_bert_legacy')
    transformers = pytest.importorskip('transformers')
    tok = data.WordPiece(vocab, lower=lower)
    as_4 = lowered_as_transformers_4 if lower else (lambda text: text)
    for ref, read in ((legacy.BertTokenizerLegacy(vocab, do_lower_case=lower), as_4),
                      (transformers.BertTokenizer(vocab, do_lower_case=lower), lambda text: text)):
        for name, text in TEXTS.items():
            if name != 'greek capitals':  # its literal [SEP] and [MASK]: below
                assert tok.encode(text) == ref.encode(read(text), add_special_tokens=False), name
        a, b = TEXTS['latin'], TEXTS['thai']
        assert tok.encode_pair(a, b) == ref(a, b)['input_ids'] and tok.encode_pair(a) == ref(a)['input_ids']
    assert (tok.pad, tok.unk, tok.bos, tok.eos, tok.mask) == (0, 100, 101, 102, 103)


def test_uncased_greek_capitals_lower_one_character_at_a_time(vocab):
    """ΑΘΗΝΑΣ is αθηνασ to transformers (2.x and 4.x's tokenize lowered each character alone; the Rust tokenizer's
    normaliser does too), not αθηνας as str.lower of the word. A literal [SEP] or [MASK] is the special token to
    transformers and text to us (docs/weights.md): compared on the words before it."""
    legacy = pytest.importorskip('transformers.models.bert.tokenization_bert_legacy')
    transformers = pytest.importorskip('transformers')
    tok, text = data.WordPiece(vocab, lower=True), TEXTS['greek capitals'].removesuffix(' [SEP] [MASK]')
    ours = tok.encode(text)
    assert ours == legacy.BertTokenizerLegacy(vocab, do_lower_case=True).encode(lowered_as_transformers_4(text),
                                                                               add_special_tokens=False)
    assert ours == transformers.BertTokenizer(vocab, do_lower_case=True).encode(text, add_special_tokens=False)
    assert [tok.pieces[i] for i in ours[:2]] == ['αθηνασ', 'οδοσ'] and tok.unk not in ours
    assert ours != [i for word in text.split() for i in tok.encode(word.lower())]  # the word lowered whole differs


def test_the_demos_vocab_reads_the_demos_text(tmp_path):
    legacy = pytest.importorskip('transformers.models.bert.tokenization_bert_legacy')
    demo = data.make_demo(str(tmp_path), n_train=20, n_eval=5)
    tok, ref = data.WordPiece(os.path.join(demo, 'vocab.txt')), legacy.BertTokenizerLegacy(
        os.path.join(demo, 'vocab.txt'), do_lower_case=False)
    texts = [t for task in ('xnli', 'mlqa') for lang in data.DEMO_LANGS for ex in data.read_split(demo, task, 'dev', lang)
             for t in (ex.get('a'), ex.get('b'), ex.get('context')) if t]
    assert [tok.encode(t) for t in texts] == [ref.encode(t, add_special_tokens=False) for t in texts]
    assert sum(tok.unk in tok.encode(t) for t in texts) == 0


@pytest.mark.parametrize('lower', [False, True], ids=['cased', 'lowercased'])
def test_spans_index_the_original_text(vocab, lower):
    tok = data.WordPiece(vocab, lower=lower)
    for name, text in TEXTS.items():
        ids, spans = tok.encode_with_spans(text)
        assert ids == tok.encode(text) and len(spans) == len(ids)
        for i, (s, e) in zip(ids, spans):  # a piece stands for its characters (lowercased and unaccented as read)
            piece = tok.pieces[i].removeprefix('##')
            read = ''.join(c for c in data.unicodedata.normalize('NFD', lowered_as_transformers_4(text[s:e]))
                           if data.unicodedata.category(c) != 'Mn') if lower else text[s:e]
            assert i == tok.unk or piece == read, (name, piece, text[s:e])


def test_an_answers_boundary_inside_a_word_cuts_it(vocab):
    """QA training: the rest of a word cut at an answer's end is read as a word's inside ('##')."""
    tok, text = data.WordPiece(vocab), 'Hello Worldwide'
    pieces = lambda ids: [tok.pieces[i] for i in ids]
    assert pieces(tok.encode(text)) == ['Hello', 'World', '##w', '##i', '##d', '##e']
    assert tok.decode(tok.encode_pair(text, 'wide')) == 'Hello Worldwide wide'  # '##' joins, specials dropped
    ids, spans = tok.encode_with_spans(text, cuts=(6, 9))  # the answer 'Wor'
    assert pieces(ids) == ['Hello', 'Wor', '##ld', '##w', '##i', '##d', '##e']
    assert [text[s:e] for s, e in spans] == ['Hello', 'Wor', 'ld', 'w', 'i', 'd', 'e']


def test_a_vocab_without_berts_specials_is_refused(tmp_path):
    (tmp_path / 'vocab.txt').write_text('[PAD]\n[UNK]\nhello\n')
    with pytest.raises(data.DataError, match='not a BERT vocab.txt'):
        data.WordPiece(str(tmp_path / 'vocab.txt'))


# ---------------------------------------------------------------------------------------
# The model against transformers' BERT.

def pairs(vocab_size):
    """[CLS] a [SEP] b [SEP] and single texts, padded with [PAD]; their token types written out by hand."""
    g = torch.Generator().manual_seed(0)
    rows = [(9, 6), (4, 0), (12, 3)]
    ids = torch.zeros(len(rows), max(a + b + 3 for a, b in rows), dtype=torch.long)
    types = torch.zeros_like(ids)
    for n, (a, b) in enumerate(rows):
        row = [101] + torch.randint(104, vocab_size, (a,), generator=g).tolist() + [102]
        row += torch.randint(104, vocab_size, (b,), generator=g).tolist() + [102] if b else []
        ids[n, :len(row)] = torch.tensor(row)
        types[n, a + 2:len(row)] = 1  # segment B: after the first [SEP], the last [SEP] with it
    return ids, types


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """transformers' BertForPreTraining, every weight moved off its initialisation, saved as its folder."""
    transformers = pytest.importorskip('transformers')
    torch.manual_seed(0)
    ref = transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=160, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp('bert')
    ref.save_pretrained(folder)
    return transformers, ref, str(folder)


def test_encoder_pooler_and_mlm_equal_transformers_bert(reference):
    transformers, ref, folder = reference
    enc, mlm = layers.load_pretrained(folder)[:2]
    assert (enc.cfg.backbone, enc.cfg.pad_id, enc.cfg.ln_eps, enc.cfg.sep_id) == ('bert', 0, 1e-12, 102)
    ids, types = pairs(160)
    real = ids.ne(0)
    with torch.no_grad():
        out = ref(input_ids=ids, attention_mask=real.long(), token_type_ids=types, output_hidden_states=True)
        pooled = ref.bert(input_ids=ids, attention_mask=real.long(), token_type_ids=types).pooler_output
        h = enc.eval()(ids)
        assert (h - out.hidden_states[-1])[real].abs().max() <= 1e-5
        assert (torch.tanh(enc.pooler(h[:, 0])) - pooled).abs().max() <= 1e-5
        assert (mlm(h) - out.prediction_logits)[real].abs().max() <= 1e-5


@pytest.mark.parametrize('family', ['classification', 'tagging', 'qa'])
def test_each_task_head_equals_its_bert_class(reference, family):
    """BertFor{SequenceClassification, TokenClassification, QuestionAnswering} on the same BERT: our Head,
    its classification dense started from the pre-trained pooler, gives their logits."""
    transformers, ref, folder = reference
    cls = {'classification': 'BertForSequenceClassification', 'tagging': 'BertForTokenClassification',
           'qa': 'BertForQuestionAnswering'}[family]
    theirs = getattr(transformers, cls).from_pretrained(folder, num_labels=3 if family != 'qa' else 2).eval()
    enc = layers.load_pretrained(folder).encoder
    head = xlt.Head(family, enc, ('a', 'b', 'c')).eval()
    last = theirs.classifier if family != 'qa' else theirs.qa_outputs
    head.out.load_state_dict(last.state_dict())
    if family == 'classification':
        assert torch.equal(head.dense.weight, ref.bert.pooler.dense.weight)  # the pre-trained pooler, loaded
    ids, types = pairs(160)
    real = ids.ne(0)
    with torch.no_grad():
        out = theirs(input_ids=ids, attention_mask=real.long(), token_type_ids=types)
        ours = head(enc.eval()(ids), real)
    if family == 'qa':
        ours, expected = ours[real], torch.stack([out.start_logits, out.end_logits], -1)[real]
    else:
        ours, expected = (ours, out.logits) if family == 'classification' else (ours[real], out.logits[real])
    assert (ours - expected).abs().max() <= 1e-5


@pytest.mark.parametrize('layout', ['safetensors', 'bin, old names', 'BertModel, no pooler', 'BertForMaskedLM'])
def test_every_bert_layout_reads_and_converts(layout, tmp_path):
    """BertForPreTraining's files (safetensors; pytorch_model.bin with the first releases' LayerNorm gamma and
    beta), a BertModel's (no 'bert.' prefix) and BertForMaskedLM's without the pooler (a new one, as
    transformers starts); the next-sentence head is left out; convert writes the same model."""
    cfg = bert_config(2, 32, 4, 64, 160)
    sd = random_bert_weights(cfg)
    if layout.startswith('bin'):
        sd = {k.replace('LayerNorm.weight', 'LayerNorm.gamma').replace('LayerNorm.bias', 'LayerNorm.beta'): v
              for k, v in sd.items()}
    if layout.startswith('BertModel'):
        sd = {k.removeprefix('bert.'): v for k, v in sd.items() if k.startswith('bert.') and 'pooler' not in k}
    if layout == 'BertForMaskedLM':  # no pooler, no next-sentence head
        sd = {k: v for k, v in sd.items() if 'pooler' not in k and 'seq_relationship' not in k}
    folder = write_hf_dir(sd, cfg, tmp_path / 'bert', fmt='bin' if layout.startswith('bin') else 'safetensors')
    write_bert_vocab(folder, ['x'])
    enc, mlm = layers.load_pretrained(folder)[:2]
    assert (mlm is None) == layout.startswith('BertModel')
    gamma = 'LayerNorm.gamma' if layout.startswith('bin') else 'LayerNorm.weight'
    prefix = '' if layout.startswith('BertModel') else 'bert.'
    assert torch.equal(enc.ln.weight, sd[f'{prefix}embeddings.{gamma}'])
    assert torch.equal(enc.token_type.weight, sd[f'{prefix}embeddings.token_type_embeddings.weight'])
    if 'bert.pooler.dense.weight' in sd:
        assert torch.equal(enc.pooler.weight, sd['bert.pooler.dense.weight'])
    layers.main(['convert', folder, str(tmp_path / 'bert.pt')])
    again = layers.load_pretrained(str(tmp_path / 'bert.pt')).encoder
    assert again.cfg == enc.cfg and all(torch.equal(a, b) for a, b in zip(enc.state_dict().values(),
                                                                          again.state_dict().values()))
    if 'bert.pooler.dense.weight' not in sd:  # a new pooler, the same at every load
        assert torch.equal(layers.load_pretrained(folder)[0].pooler.weight, enc.pooler.weight)


@pytest.mark.slow
def test_xmixup_runs_on_an_mbert_sized_folder_in_the_real_layout(tmp_path):
    """The acceptance command: python train.py --method xmixup --task xnli --model mbert --init <a BERT folder>,
    from random weights of mBERT's shape (a small vocabulary: the demo's vocab.txt, read beside the weights)."""
    demo = data.make_demo(str(tmp_path / 'demo-data'), n_train=8, n_eval=3)
    vocab = open(os.path.join(demo, 'vocab.txt'), encoding='utf-8').read()
    cfg = bert_config(12, 768, 12, 3072, vocab.count('\n'))
    folder = write_hf_dir(random_bert_weights(cfg), cfg, tmp_path / 'mbert')
    (tmp_path / 'mbert' / 'vocab.txt').write_text(vocab, encoding='utf-8')
    demo_run(tmp_path / 'run', demo, ['--method', 'xmixup', '--task', 'xnli', '--model', 'mbert', '--init', folder,
                                      '--epochs', '1', '--batch_size', '24', '--max_len', '32'])  # one step
    meta = layers.load_checkpoint(str(tmp_path / 'run' / 'best.pt'))['meta']
    assert meta['tokenizer'] == [os.path.join(folder, 'vocab.txt')] and meta['model'] == 'mbert'  # read beside --init
    assert set(json.load(open(tmp_path / 'run' / 'results.json'))['test']) >= set(data.DEMO_LANGS)


def test_where_wordpiece_differs_from_transformers_as_its_docs_say(vocab):
    """docs/weights.md: no NFC first, as XTREME's transformers 2.x and transformers' Rust tokenizer (transformers 5's
    Python one has it); a literal [SEP] in the text is text."""
    legacy = pytest.importorskip('transformers.models.bert.tokenization_bert_legacy')
    transformers = pytest.importorskip('transformers')
    tok, ref = data.WordPiece(vocab), legacy.BertTokenizerLegacy(vocab, do_lower_case=False)
    rust = transformers.BertTokenizer(vocab, do_lower_case=False)
    decomposed = 'Cafe\u0301 crème'
    composed = data.unicodedata.normalize('NFC', decomposed)
    assert tok.encode(composed) == ref.encode(decomposed, add_special_tokens=False) != tok.encode(decomposed)
    assert tok.encode(decomposed) == rust.encode(decomposed, add_special_tokens=False)
    literal = 'Hello [SEP] World'
    assert tok.eos in ref.encode(literal, add_special_tokens=False) and tok.eos not in tok.encode(literal)


def test_an_uncased_vocabulary_lowercases_and_its_tokenizer_config_decides(tmp_path, vocab):
    """No capital in the vocabulary (bert-base-uncased's): lowercased, accents stripped; a tokenizer_config.json
    beside it says do_lower_case, as Hugging Face's folders do."""
    lines = open(vocab, encoding='utf-8').read().splitlines()
    (tmp_path / 'vocab.txt').write_text(''.join(line + '\n' for line in dict.fromkeys(
        line if line.startswith('[') else line.lower() for line in lines)), encoding='utf-8')
    tok = data.WordPiece(str(tmp_path / 'vocab.txt'))
    assert tok.lower and tok.encode('CAFÉ Crème') == tok.encode('cafe creme')
    (tmp_path / 'tokenizer_config.json').write_text(json.dumps({'do_lower_case': False}))
    assert not data.WordPiece(str(tmp_path / 'vocab.txt')).lower
    assert not data.WordPiece(vocab).lower  # a cased one, as mBERT's


def test_in_language_keeps_its_own_languages_best_dev_and_without_one_the_last_epoch():
    dev = {'en': {'score': 90.0}, 'de': {'score': 70.0}, 'zh': {'score': 40.0}}
    assert xlt.selection('de', dev) == (70.0, 'best dev score of de')
    assert xlt.selection('kk', dev) == (None, 'last epoch (no kk dev set)')  # not the others' average
    assert xlt.selection('en', dev) == (90.0, 'best English dev score') and xlt.selection('average', dev)[0] == 200 / 3


def test_a_teacher_of_the_other_backbone_is_refused_in_one_line(tmp_path):
    """Its probabilities would be of another tokenizer's ids: an XLM-R run cannot teach a BERT student."""
    teacher = tmp_path / 'teacher'
    teacher.mkdir()
    (teacher / 'results.json').write_text('{}')
    layers.save_checkpoint(str(teacher / 'best.pt'), {'task': 'panx'}, config={'family': 'xlmr'})
    one_line(['--method', 'xmixup', '--task', 'panx', '--demo', '--model', 'tiny-bert', '--teacher', str(teacher),
              '--out', str(tmp_path / 'run')], f'--teacher {teacher} is a run of xlmr, this one of bert: give a run of '
             'the same model')
