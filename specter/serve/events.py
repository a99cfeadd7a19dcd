"""Server-sent events: `data: {json}` lines, and a streaming response that calls back when its client goes away."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.responses import StreamingResponse

DONE = "data: [DONE]\n\n"


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """An SSE response that stops as soon as its client disconnects (whatever ASGI version the server speaks) and
    always calls `on_close` at the end: a finished or a cancelled stream."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def until_done(step) -> None:
                    try:
                        await step()
                    except OSError:
                        pass  # the client went away while a chunk was on its way
                    group.cancel_scope.cancel()

                group.start_soon(until_done, lambda: self.stream_response(send))
                await until_done(lambda: self.listen_for_disconnect(receive))
        finally:
            self.on_close()
