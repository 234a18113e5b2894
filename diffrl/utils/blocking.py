"""Waiting for a coroutine from synchronous code, whether or not an event loop runs in this thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def run_blocking(make: Callable[[], Awaitable[T]]) -> T:
    """`await make()` on a fresh event loop: this thread's, or (when a loop already runs here, which
    `asyncio.run` refuses) a helper thread's."""

    async def wait() -> T:
        return await make()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, wait()).result()
