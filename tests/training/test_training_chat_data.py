"""Demo training dialogue: speeches parsed from the play format, conversations rendered
exactly as the server encodes a chat request (server/chat/chat_encoding.py is the oracle)."""

from __future__ import annotations

import pytest

from server.chat.chat_encoding import EOS, encode_chat
from server.chat.tool_calls import THINK_END
from server.openai.protocol import ChatCompletionRequest
from training.chat_data import render_conversation, speeches

PLAY = """HAMLET, PRINCE OF DENMARK

ACT I.

Scene I. Elsinore. A platform before the Castle.

[Francisco at his post. Enter to him Bernardo.]

Ber.
Who's there?

Fran.
Nay, answer me: stand, and unfold yourself.
[Aside.]

First Clown.
Is she to be buried in Christian burial

THESEUS
        What say you, Hermia?
Be advis'd, fair maid."""


def test_speeches_drop_speakers_stage_directions_and_indentation() -> None:
    assert speeches(PLAY) == [
        "Who's there?",
        "Nay, answer me: stand, and unfold yourself.",
        "Is she to be buried in Christian burial",
        "What say you, Hermia?\nBe advis'd, fair maid.",
    ]


def _prompt_and_reply(turns: list[str], thinking: bool, system: str | None, effort: int) -> str:
    """The server's prompt for all but the last turn, then that turn as the model's output
    (empty reasoning closed by ``</think>`` when thinking, the reply, EOS)."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    for i, text in enumerate(turns[:-1]):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    prompt = encode_chat(request.messages, thinking=thinking, reasoning_effort=effort)
    return prompt + (THINK_END if thinking else "") + turns[-1] + EOS


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("system", [None, "The Tempest"])
@pytest.mark.parametrize("exchanges", [1, 3])
def test_conversation_is_the_server_encoding(
    thinking: bool, system: str | None, exchanges: int
) -> None:
    turns = [f"line {i}\nof verse" for i in range(2 * exchanges)]
    rendered = render_conversation(turns, thinking=thinking, system=system, effort=42)
    assert rendered == _prompt_and_reply(turns, thinking, system, 42)


def test_conversation_needs_a_final_reply() -> None:
    with pytest.raises(ValueError, match="assistant"):
        render_conversation(["a", "b", "c"], thinking=False)


def test_served_ends_start_plays_with_bos_and_end_chat_with_eos() -> None:
    """``served_ends``: a play window is BOS then a run of the play's own tokens (as a
    completion prompt is sent); a chat sequence ends with a reply's EOS."""
    import torch

    from training.bpe import BOS_ID, EOS_ID, train_bpe
    from training.corpus import Play
    from training.data import SequenceSampler, encode_play

    play = Play("h", "Hamlet", PLAY.split("\n\n", 4)[-1] * 30)
    tokenizer = train_bpe([play.text], 360)
    stream = encode_play(tokenizer, play)
    plays = SequenceSampler(tokenizer, [play], 48, 0.0, 3, served_ends=True)
    for _ in range(6):
        ids = plays.sample()
        assert len(ids) == 49 and int(ids[0]) == BOS_ID
        body = ids[1:]
        assert any(torch.equal(stream[s : s + 48], body) for s in range(1, len(stream) - 47)), (
            "not a window of the play"
        )
    chat = SequenceSampler(tokenizer, [play], 48, 1.0, 3, served_ends=True)
    default = SequenceSampler(tokenizer, [play], 48, 1.0, 3)
    ends = [int(chat.sample()[-1]) for _ in range(6)]
    assert ends == [EOS_ID] * 6
    # The default cut (what the committed demo was trained on) lands anywhere.
    assert [int(default.sample()[-1]) for _ in range(6)] != [EOS_ID] * 6


def test_first_sentences_cuts_after_a_line_that_ends_a_sentence() -> None:
    from training.data import first_sentences

    speech = "Nay, answer me:\nstand, and unfold yourself.\nLong live the king!\nWho, ho?\nand more"
    assert first_sentences(speech, 1) == "Nay, answer me:\nstand, and unfold yourself."
    assert first_sentences(speech, 2) == (
        "Nay, answer me:\nstand, and unfold yourself.\nLong live the king!"
    )
    assert first_sentences(speech, 3) == "\n".join(speech.split("\n")[:4])
    # Fewer sentence ends than asked for (or none): the whole speech.
    assert first_sentences(speech, 4) == speech
    assert first_sentences("no end here\nnor here", 1) == "no end here\nnor here"


def test_short_replies_keep_a_reply_to_its_first_sentences() -> None:
    """``short_replies=1``: every assistant reply is the first lines of one of the play's
    speeches, ending a sentence (or the whole speech); user turns stay whole."""
    import re

    from training.bpe import ASSISTANT, USER, train_bpe
    from training.corpus import Play
    from training.data import SequenceSampler

    verse = "Who's there?\n\nFran.\nNay, answer me. Stand,\nand unfold yourself.\nI say!\nGo on"
    body = "\n\n".join(f"Ber.\n{verse}\nline {i}.\nand more {i}" for i in range(40))
    play = Play("h", "Hamlet", body)
    tokenizer = train_bpe([play.text], 300)
    sampler = SequenceSampler(tokenizer, [play], 48, 1.0, 5, short_replies=1.0)
    lines = sampler.speeches[0]
    cut = 0
    for _ in range(20):
        text = sampler.conversation()
        for user, reply in re.findall(
            re.escape(USER) + r"(.*?)" + re.escape(ASSISTANT) + r"(?:<think>)?</think>(.*?)" + EOS,
            text,
            flags=re.S,
        ):
            assert user in lines
            whole = [s for s in lines if s.startswith(reply)]
            assert whole, reply
            assert reply in whole or reply.endswith((".", "!", "?"))
            cut += reply not in lines
    assert cut > 0  # some replies were shortened
