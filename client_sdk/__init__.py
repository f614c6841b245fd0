"""proxrl's Python client: runs, sessions and rewards over the REST API, and stock OpenAI
clients pointed at a session for the agent's model calls.

    from client_sdk import Client

    with Client("http://127.0.0.1:8000", admin_key="...") as client:
        with client.session(task_id="add-17-25") as session:
            reply = session.openai().chat.completions.create(model="tiny", messages=[...])
            session.reward(1.0)

``AsyncClient`` is the same API awaited. Every error is a ``ProxrlError`` (the tree is drawn in
``client_sdk._errors``). The package imports httpx only (openai when a session's OpenAI client
is asked for), and nothing of the server or the trainer.
"""

from client_sdk._async_client import AsyncClient, AsyncSession
from client_sdk._base import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT
from client_sdk._client import Client, Session
from client_sdk._errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    ProxrlError,
    RateLimitError,
    UnprocessableEntityError,
)
from client_sdk._types import (
    EvalFigures,
    Promotion,
    PromotionCandidate,
    RewardResult,
    Row,
    Run,
    RunCreated,
    RunEval,
    RunMetrics,
    RunTraining,
    SessionCreated,
    SessionDetail,
    SessionEnded,
    Turn,
)

__all__ = [
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT",
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncSession",
    "AuthenticationError",
    "BadRequestError",
    "Client",
    "ConflictError",
    "EvalFigures",
    "InternalServerError",
    "NotFoundError",
    "PermissionDeniedError",
    "Promotion",
    "PromotionCandidate",
    "ProxrlError",
    "RateLimitError",
    "RewardResult",
    "Row",
    "Run",
    "RunCreated",
    "RunEval",
    "RunMetrics",
    "RunTraining",
    "Session",
    "SessionCreated",
    "SessionDetail",
    "SessionEnded",
    "Turn",
    "UnprocessableEntityError",
]
