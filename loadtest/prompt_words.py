"""The word list both load generators (locustfile.py, bench_serving.py) build random prompts
from, and the tokens-per-word ratio they assume when the server's /tokenize is unavailable.
Imported as a sibling module: both run as scripts from this folder (locust -f, python)."""

_WORDS_TEXT = (
    "the of and to in is was for on that with as by at from his her they this be are or an which "
    "one had not but all were when there can more has their been would will what if who out so "
    "about up into them other time some could these two may then do first any like my now over "
    "such our man me even most made after also did many before must through back years where much "
    "your way well down should because each just those people how too little state good very make "
    "world still own see men work long get here between both life being under never day same "
    "another know while last might us great old year off come since against go came right used "
    "take three small house number water light river system market theory music history garden"
)
WORDS = _WORDS_TEXT.split()
FALLBACK_TOKENS_PER_WORD = 1.3
