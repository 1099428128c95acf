"""Prompt text with exactly a trace's reuse pattern: every hash id maps to a deterministic block of words.

The same id always gives the same words (seeded by the id), so equal ids across turns and agents give
equal text and the server can reuse exactly what the trace says was reusable. Blocks are runs of
space-prefixed words: a byte-level BPE tokenizer never merges across the space before a word, so the
tokens of a block prefix are a prefix of the tokens of the whole text, and a block's token count is about
its word count times the tokens per word measured once against the served tokenizer (calibration).

Layout of a request (a documented choice): the first block is the system prompt, the rest are one growing
user message. A turn whose ids share a prefix with an earlier turn therefore shares the system prompt and
the start of the user message, and the shared text ends at the first differing block. With `messages` (the load
generator's --messages) the rest is a conversation as a coding agent sends one instead: per earlier turn that this
one extends, a user message of the blocks that turn added and an assistant message of ASSISTANT_REPLY, then a user
message of this turn's new blocks; the shared text is then whole messages.

Context scaling multiplies the tokens of every block (block_tokens * factor, kept fractional) and keeps
the ids: which blocks repeat, and in which order, does not change; blocks only get shorter. A block of
fewer tokens than a word gets 0 or 1 words (dithered by its id, so the average stays right); an empty
block can make two different id sequences look alike for a word, a negligible extra reuse.
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass

from loadgen.traces import TraceTurn

# Plain lowercase words: common, so each is one or two tokens in any BPE vocabulary; varied enough that
# two different blocks never share more than a word or two of prefix by chance.
_WORD_LIST = """
    able about above accept access account across action active actual adapt added adding address adjust
    after again agent allow alone along already also always amount angle annual answer anyone apply area
    argue around array arrive aside asset async attach attempt audio author auto avoid await aware back
    badge balance band base basic batch beach bear begin behind below benefit best better between beyond
    bind block board body bold bonus book boost border bottom bound branch bread break bridge brief bring
    broad broken brown buffer build bundle burst button bytes cache call calm camera cancel canvas capital
    card care carry case catch cause cell center chain chair change channel chapter charge chart check
    child choice choose chunk circle claim class clean clear client climb clock close cloud cluster code
    coffee cold collect color column combine comment common commit compare compile complex config connect
    consider contain content context control convert copy core corner correct count couple course cover
    craft create credit cross crowd current cursor curve custom cycle daily damage dance data date debug
    decide decode deep default define degree delay delete deliver demand deploy depth derive design detail
    detect device differ digit direct dirty disk display distance divide doctor domain double draft drive
    drop early earth easy edge edit effect effort eight either element email empty enable encode energy
    engine enough ensure enter entry equal error escape event every exact example except exist expand
    expect export extend extra face fact factor fail fair fall false family fast feature field figure file
    fill filter final find finish first fixed flag flat float floor flow focus folder follow force form
    format forward frame free fresh front full function future gain game garden gather general gentle
    global goal good graph great green ground group grow guard guess guide handle happy hard hash head
    health heart heavy height help hidden high hint history hold home hook host hour house human idea
    image impact import index inner input insert inside install issue item join journal judge jump keep
    kernel key kind label lake large last later layer layout lead learn least leave left length level
    library light limit line link list little live load local lock logic long loop lower machine main
    major make manage manual many margin mark market match matter maybe measure media memory merge message
    method middle minor mirror mode model module moment money month more morning mount move much music
    name native near need nested network never next night node noise normal note number object ocean offer
    office offset often open option order origin other output owner package page panel paper parent parse
    part party pass patch path pattern pause peace people period person phase phone phrase piece pilot
    pipe place plain plan plant play point policy pool port position power press price print private
    probe process produce profile program project prompt proof proper public pull purpose push query
    queue quick quiet quote radio raise range rate reach read ready real reason record reduce refer region
    release remote remove render repeat reply report request reset resolve result return review right
    river road role root round route rule runtime safe sample save scale scene schema scope score screen
    script search season second section secure select send sense series serve session setting shape share
    shell shift short signal silver simple single size skill sleep slice slot small smooth socket solid
    solve sort source space spare speak special speed split spring stable stack stage standard start state
    status step still stone stop store story stream street string strong style subject submit summer
    supply support surface switch symbol sync system table tail take target task team template term test
    text theme thing thread three ticket time title today token tool topic total touch trace track train
    travel tree trigger true trust type under union unit update upper usage user valid value vector
    version video view visit voice volume wait walk watch water wave weight while white whole window
    winter word work world write yellow yield young zone
"""
WORDS = tuple(_WORD_LIST.split())


@functools.lru_cache(maxsize=262_144)
def block_words(hash_id: int, count: int) -> tuple[str, ...]:
    """The first `count` words of the block of `hash_id` (a shorter count is a prefix of a longer one)."""
    rng = random.Random(hash_id)
    return tuple(rng.choice(WORDS) for _ in range(count))


@functools.lru_cache(maxsize=262_144)
def block_word_count(hash_id: int, words_per_block: float) -> int:
    """Words in a full block: floor or ceil of words_per_block, dithered by the id so the mean is exact."""
    whole = int(words_per_block)
    dither = random.Random(hash_id ^ 0x5EED).random()
    return whole + (1 if dither < words_per_block - whole else 0)


@functools.lru_cache(maxsize=262_144)
def block_text(hash_id: int, words: int) -> str:
    """The text of a block (or of its first `words` words): space-prefixed words."""
    return "".join(" " + word for word in block_words(hash_id, words))


# What every assistant message of a --messages conversation says: the same on every server, so the token ids sent
# are the same on both sides of a comparison (the models' own outputs differ, so they are never sent back)
ASSISTANT_REPLY = "Done: the tool ran."


@dataclass(frozen=True)
class Prompt:
    system: str
    user: str
    # --messages: the user text cut into one message per turn, an ASSISTANT_REPLY between each two; () for one
    user_turns: tuple[str, ...] = ()


@dataclass(frozen=True)
class ContentBuilder:
    """Builds a turn's prompt: tokens_per_word is the calibrated value for the served tokenizer, factor the
    context scale (applied to the trace's unscaled block_tokens and input_tokens)."""

    tokens_per_word: float
    factor: float = 1.0
    messages: bool = False  # a conversation of messages, one per turn (the module's layout), not one message

    def words_per_block(self, turn: TraceTurn) -> float:
        return turn.block_tokens * self.factor / self.tokens_per_word

    def words_for_turn(self, turn: TraceTurn) -> list[int]:
        """Words per block of the turn: full blocks, and a last block cut to the trace's input size."""
        per_block = self.words_per_block(turn)
        counts = [block_word_count(h, per_block) for h in turn.hash_ids]
        if counts:
            wanted_words = turn.input_tokens * self.factor / self.tokens_per_word
            before_last = sum(counts[:-1])
            counts[-1] = max(0, min(counts[-1], round(wanted_words - before_last)))
        return counts

    def prompt(self, turn: TraceTurn, counts: list[int] | None = None, earlier: tuple[int, ...] = ()) -> Prompt:
        """System = the first block, user = the rest (one growing message); a one-block turn is all user.
        counts: words_for_turn(turn) when the caller has it already. earlier (with `messages`): the block counts at
        which the earlier turns this one extends ended, where its user text is cut into messages."""
        counts = self.words_for_turn(turn) if counts is None else counts
        texts = [block_text(h, n) for h, n in zip(turn.hash_ids, counts, strict=True)]
        if len(texts) < 2:
            return Prompt(system="", user="".join(texts).strip() or "start")
        user = "".join(texts[1:]).strip() or "continue"
        if not self.messages:
            return Prompt(system=texts[0].strip() or "system", user=user)
        cuts = [1, *(end for end in earlier if 1 < end < len(texts)), len(texts)]
        parts = tuple("".join(texts[a:b]).strip() or "continue" for a, b in itertools.pairwise(cuts))
        return Prompt(system=texts[0].strip() or "system", user=user, user_turns=parts)

    def expected_tokens(self, turn: TraceTurn, counts: list[int] | None = None) -> int:
        """The scaled input size this builder aims at (prompt template tokens not included)."""
        counts = self.words_for_turn(turn) if counts is None else counts
        return round(sum(counts) * self.tokens_per_word)


def turn_ends(previous: tuple[int, ...], ends: tuple[int, ...], turn: TraceTurn) -> tuple[int, ...]:
    """`earlier` for ContentBuilder.prompt: the block counts at which the turns this one extends ended, from the
    previous turn's ids and its own `earlier`; () when it does not extend the previous turn (a first call, or a
    context the trace rewrote)."""
    if previous and turn.hash_ids[: len(previous)] == previous:
        return (*ends, len(previous))
    return ()


def calibration_text(words: int, seed: int = 7) -> str:
    """Sample text for measuring tokens per word: blocks of the same kind as the prompts."""
    parts: list[str] = []
    hash_id = -(10**15) - seed * 10**6  # far away from any trace id
    while words > 0:
        take = min(words, 64)
        parts.append(block_text(hash_id, take))
        words -= take
        hash_id -= 1
    return "".join(parts).strip()
