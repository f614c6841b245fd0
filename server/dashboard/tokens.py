"""The token viewer's data: each training row position by position, with token texts.

Pure: it takes the rows the store assembled (the same the trainer claims) and a function that
gives a token's text; it knows nothing about SQL or HTML.
"""

from __future__ import annotations

from collections.abc import Callable

from server.dashboard.schemas import TokenRow
from server.rl.schemas import RowOut

PROMPT_TURN = -1


def token_rows(rows: list[RowOut], token_text: Callable[[int], str]) -> list[TokenRow]:
    """Rows with each token's text and the index of the turn that sampled it."""
    texts: dict[int, str] = {}

    def text(token_id: int) -> str:
        if token_id not in texts:
            texts[token_id] = token_text(token_id)
        return texts[token_id]

    out = []
    for row in rows:
        turn = [PROMPT_TURN] * len(row.input_ids)
        for index, span in enumerate(row.turns):
            for position in range(span["start"], span["end"]):
                turn[position] = index
        out.append(
            TokenRow(
                row_index=row.row_index,
                ids=row.input_ids,
                pieces=[text(token_id) for token_id in row.input_ids],
                logprobs=row.logprobs,
                versions=row.versions,
                loss_mask=row.loss_mask,
                turn=turn,
                turns=row.turns,
            )
        )
    return out
