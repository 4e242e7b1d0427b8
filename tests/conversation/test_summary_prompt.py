"""The summary prompt: the summarized items as a transcript, the request after it."""

from __future__ import annotations

from courier.conversation.items import message_item, reasoning_item, text_part
from courier.conversation.summary_prompt import SUMMARY_REQUEST, summary_messages


def test_the_transcript_names_each_speaker_and_leaves_the_reasoning_out() -> None:
    items = [
        message_item("user", [text_part("input_text", "Book the 09:15 train.")]),
        reasoning_item("The user wants the early train; check seats first."),
        message_item("assistant", [text_part("output_text", "Booked: 09:15, seat 42.")]),
    ]
    (message,) = summary_messages(items)
    assert message["role"] == "user"
    assert message["content"] == (
        f"Conversation:\n\nUser: Book the 09:15 train.\n\nAssistant: Booked: 09:15, seat 42.\n\n{SUMMARY_REQUEST}"
    )
