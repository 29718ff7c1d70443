"""Tests of `groupflow.impl.aio`: the asyncio host."""
