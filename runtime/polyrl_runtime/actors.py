"""Typed calls to Ray actors, and when a failed call means the actor is gone for good.

Typed calls. Ray types every method of an `ActorHandle[T]` as `Never`, so a checker accepts any
`.remote(...)` call and treats the code after it as unreachable. Here a call names the method
itself: `call(handle, ExperienceService.stats)` is checked against the method's signature and
returns `ObjectRef[<its return type>]` (await it, or `ray.get` it). Each actor has a client class
beside it (experience/client.py, engines/client.py, trainers/client.py, workflows/client.py) whose
methods are such calls, so the rest of the code calls `buffer.stats()`, typed end to end. A handle
is typed by the class or Protocol whose methods its client calls: `start_actor` checks the
constructor's arguments and, for a Protocol, that the class implements it.

Gone: the actor died (`RayActorError` and its subclasses), or it was never created because its node
could not set up the actor's runtime environment (`RuntimeEnvSetupError`, e.g. a raylet that gets no
answer from its runtime-env agent). Every later call to such an actor fails the same way, so both
cases must move its episodes to the policy's other engines and drop it from the weight sync.
Everything that decides "this actor is gone" (the engine pool, the weight sync, the driver, the
producer) asks here, so the two cases are handled alike.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, overload

import ray
from ray.actor import ActorHandle

ACTOR_GONE: tuple[type[Exception], ...] = (ray.exceptions.RayActorError, ray.exceptions.RuntimeEnvSetupError)

P = ParamSpec("P")
R = TypeVar("R")
A = TypeVar("A")
# Covariant: a client of a subclass (or of a class implementing a Protocol) is a client of the base.
A_co = TypeVar("A_co", covariant=True)


def actor_gone(error: BaseException) -> bool:
    """True when `error` (from a call to an actor) means that actor will never answer again."""
    return isinstance(error, ACTOR_GONE)


def start_actor(
    cls: Callable[P, A], options: Mapping[str, Any], /, *args: P.args, **kwargs: P.kwargs
) -> ActorHandle[A]:
    """Start an actor of `cls` with Ray's actor `options`; `args` are checked against its constructor.

    Annotate the result as `ActorHandle[SomeProtocol]` to check that `cls` implements the Protocol."""
    remote_class: Any = ray.remote(cls)  # typed as a remote function: `cls` is any callable here
    handle: ActorHandle[A] = remote_class.options(**options).remote(*args, **kwargs)
    return handle


@overload
def call(
    handle: ActorHandle[A],
    method: Callable[Concatenate[A, P], Awaitable[R]],
    /,
    *args: P.args,
    **kwargs: P.kwargs,
) -> ray.ObjectRef[R]: ...


@overload
def call(
    handle: ActorHandle[A], method: Callable[Concatenate[A, P], R], /, *args: P.args, **kwargs: P.kwargs
) -> ray.ObjectRef[R]: ...


def call(handle: Any, method: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """`handle.<method>.remote(*args, **kwargs)`, with `method` given as the class's own function:
    its arguments are checked and the reference is typed by its return type (a coroutine method's
    reference holds what the coroutine returns)."""
    return getattr(handle, method.__name__).remote(*args, **kwargs)


def stream(
    handle: ActorHandle[A],
    method: Callable[Concatenate[A, P], AsyncIterator[R]],
    /,
    *args: P.args,
    **kwargs: P.kwargs,
) -> AsyncIterator[ray.ObjectRef[R]]:
    """Call a generator method with each item streamed back as it is yielded (one reference per item)."""
    actor: Any = handle
    refs: AsyncIterator[ray.ObjectRef[R]] = (
        getattr(actor, method.__name__).options(num_returns="streaming").remote(*args, **kwargs)
    )
    return refs


class BoundMethod:
    """A remote method with its first argument given (`BoundHandle`)."""

    def __init__(self, method: Any, first: object) -> None:
        self._method, self._first = method, first

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._method.remote(self._first, *args, **kwargs)

    def options(self, **options: Any) -> BoundMethod:
        return BoundMethod(self._method.options(**options), self._first)


class BoundHandle:
    """An actor's handle whose every method call gets `first` as its first argument: one actor that
    serves several callers (a shared trainer rank, one per policy), each calling it through a client
    as if it were theirs alone. Ray's own calls (`__ray_ready__`) reach the actor as they are, and
    `ray.kill` takes `unbound(handle)`."""

    def __init__(self, actor: ActorHandle[Any], first: object) -> None:
        self.actor, self.first = actor, first

    def __getattr__(self, name: str) -> Any:
        if name in ("actor", "first"):  # not set yet (an unpickled copy): not the actor's to answer
            raise AttributeError(name)
        method = getattr(self.actor, name)
        return method if name.startswith("__") else BoundMethod(method, self.first)


def unbound(handle: Any) -> Any:
    """The actor handle itself, for a `BoundHandle` or a plain one."""
    return handle.actor if isinstance(handle, BoundHandle) else handle


class Actor(Protocol):
    """Any actor's client, as start-up (waiting for it) and shut-down (stopping it) see it."""

    def ready(self) -> ray.ObjectRef[None]: ...

    def kill(self) -> None: ...


@dataclass(frozen=True)
class ActorClient(Generic[A_co]):
    """A client of one actor: its subclasses add one method per remote method they call."""

    handle: ActorHandle[A_co]

    def ready(self) -> ray.ObjectRef[None]:
        """Answered once the actor is constructed (its process started and its `__init__` returned)."""
        actor: Any = self.handle
        ref: ray.ObjectRef[None] = actor.__ray_ready__.remote()
        return ref

    def kill(self) -> None:
        """Stop the actor (asynchronously: a call made right after may still be answered)."""
        ray.kill(unbound(self.handle), no_restart=True)
