"""The EPP's decision for one request: which node's gateway serves it, or the refusal a gateway would give.

Two halves. `read_request` is pure and runs off the event loop: it parses the body as the node gateways do
(gateway/api/: the same schemas, conversion and conversation checks), renders and tokenizes the prompt with each
served model's own template and tokenizer, and hashes its blocks as the gateway does (gateway/ranks/
prompt_hashes.py), so the hashes equal those the nodes' ranks report in their KV events. `Picker.choose` runs
on the loop against the live fleet: the nodes' cache matches (fleet_index.py), their load (node_state.py) and
the session's last node, through gateway/epp/node_choice.py.

Paths that are not a chat endpoint (/v1/models, count_tokens, ...) go to the least loaded ready node.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.api.anthropic.routes import MESSAGES
from gateway.api.openai.routes import CHAT_COMPLETIONS
from gateway.epp.fleet_config import FleetConfig
from gateway.epp.fleet_index import FleetIndex
from gateway.epp.node_choice import NodeCandidate, NodeChoice, NodePolicy, choose_node
from gateway.epp.node_state import NodeState
from gateway.flow import ChatApi
from gateway.http.apis import RegisteredApi
from gateway.http.app import APIS
from gateway.http.body_parse import body_from_bytes
from gateway.http.errors import ApiError, ModelNotAvailable, api_error_for
from gateway.prompt.chat import ChatRequest
from gateway.prompt.conversation_rules import check_conversation
from gateway.prompt.prompt_format import PromptFormat, prompt_of
from gateway.prompt.served_model import ServedModel
from gateway.ranks.prompt_hashes import prompt_block_hashes, route_block_hashes
from gateway.ranks.session_key import routing_session_id
from protos import rank_worker_pb2 as pb

log = logging.getLogger(__name__)


# The chat APIs the node gateways serve, by the name each registered (gateway/http/apis.py): their schemas,
# session headers and conversions are the ones the EPP reads a request with.
CHAT_APIS: dict[str, ChatApi] = {api.name: api for api in (MESSAGES, CHAT_COMPLETIONS)}


def chat_api(path: str) -> ChatApi | None:
    """The API whose generation endpoint `path` is (Envoy's :path keeps the query: Claude Code sends ?beta=true)."""
    registered = APIS.chat_api(path.partition("?")[0])
    return CHAT_APIS[registered.name] if registered is not None else None


def error_api(path: str) -> RegisteredApi:
    """The API whose error shape answers a refusal on `path`, as the gateway picks it for a path."""
    return APIS.for_path(path)


class Refusal(Exception):
    """The request is answered by the EPP itself (Envoy's ImmediateResponse), in its API's error shape."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


def refusal_for(exc: BaseException) -> Refusal:
    return exc if isinstance(exc, Refusal) else Refusal(api_error_for(exc))


class Prompter:
    """One served model's prompt path: name check, template, tokenizer, block hashes."""

    def __init__(self, info: pb.ModelInfoResponse) -> None:
        self.info = info
        self.model = ServedModel.from_info(info)
        self.prompts = PromptFormat.for_model(self.model)

    def serves(self, name: str) -> bool:
        return name in self.model.names

    def block_hashes(self, chat: ChatRequest) -> tuple[int, list[bytes]]:
        """The prompt's size in tokens and the hashes of its blocks a cache may serve."""
        _, ids = prompt_of(self.model, self.prompts, chat)
        hashes = prompt_block_hashes(self.info, ids)
        return len(ids), route_block_hashes(self.info, len(ids), hashes)


@dataclass(frozen=True)
class ReadRequest:
    session: str  # the routing session id, "" for none
    model: str
    prompt_tokens: dict[int, int]  # prompter id -> the prompt's tokens under its model
    hashes: dict[int, list[bytes]]  # prompter id -> the prompt's block hashes


def read_request(path: str, headers: dict[str, str], body: bytes, prompters: Sequence[Prompter]) -> ReadRequest:
    """The request as the node gateways would read it; Refusal for what they would refuse."""
    api = chat_api(path)
    if api is None:
        return ReadRequest("", "", {}, {})
    try:
        parsed = body_from_bytes(body, api.schema)
        chat = api.to_chat(parsed, headers.get(api.session_header, ""))
        check_conversation(chat)
        serving = [prompter for prompter in prompters if prompter.serves(chat.model)]
        if prompters and not serving:
            prompters[0].model.check_name(chat.model)  # raises ModelNotAvailable naming what is served
        tokens: dict[int, int] = {}
        hashes: dict[int, list[bytes]] = {}
        for prompter in serving:
            tokens[id(prompter)], hashes[id(prompter)] = prompter.block_hashes(chat)
    except Exception as exc:
        raise refusal_for(exc) from None
    session = routing_session_id(chat.session_id) if chat.session_id else ""
    return ReadRequest(session, chat.model, tokens, hashes)


@dataclass(frozen=True)
class Decision:
    node: NodeState
    choice: NodeChoice
    session: str
    prompt_tokens: int
    cached_tokens: int  # what the chosen node's L0 and L1 were seen to hold


class Picker:
    def __init__(self, config: FleetConfig, nodes: Sequence[NodeState], index: FleetIndex) -> None:
        self.config = config
        self.nodes = list(nodes)
        self.index = index
        self.policy = NodePolicy(
            config.policy,
            l1_restore_cost=config.l1_restore_cost,
            overload_prefill_tokens=config.overload_prefill_tokens,
        )
        self._prompters: dict[bytes, Prompter] = {}  # a model info's bytes -> its prompter
        # node -> (the model info its prompter was found for, that prompter): a model info (its tokenizer's JSON
        # is megabytes) is serialized once when a node's poller fetches it, not for each request
        self._node_prompters: dict[str, tuple[pb.ModelInfoResponse, Prompter]] = {}
        self._sessions: collections.OrderedDict[str, str] = collections.OrderedDict()  # session -> node name
        self._turn = 0

    def prompters(self) -> list[Prompter]:
        """One per distinct model info among the ready nodes (usually one: a pool serves one model)."""
        found: list[Prompter] = []
        for node in self.ready_nodes():
            prompter = self._prompter(node)
            if prompter not in found:
                found.append(prompter)
        return found

    def ready_nodes(self) -> list[NodeState]:
        return [node for node in self.nodes if node.ready and node.info is not None and node.destination]

    def choose(self, request: ReadRequest, path: str) -> Decision:
        ready = self.ready_nodes()
        if not ready:
            raise Refusal(ApiError(503, "api_error", "no kvserve node is ready; retry later", 5))
        if request.model:
            ready = [node for node in ready if self._prompter(node).serves(request.model)]
            if not ready:
                raise refusal_for(ModelNotAvailable(f"Model {request.model} is not served by any ready node"))
        shed = self.config.shed_prefill_tokens
        if shed and all(node.queued_prefill_tokens / node.ranks >= shed for node in ready):
            raise Refusal(ApiError(429, "rate_limit_error", "every kvserve node is overloaded; retry later", 2))
        candidates: list[NodeCandidate] = []
        prompt_tokens = 0
        cached: dict[str, int] = {}
        for node in ready:
            l0 = l1 = 0
            if request.model:
                prompter_id = id(self._prompter(node))
                prompt_tokens = request.prompt_tokens.get(prompter_id, 0)
                match = self.index.match(node.name, request.hashes.get(prompter_id, []))
                block_size = node.info.block_size
                l0, l1 = match.l0_blocks * block_size, match.l1_blocks * block_size
            cached[node.name] = l0 + l1
            candidates.append(
                NodeCandidate(
                    node.name,
                    node.ranks,
                    l0,
                    l1,
                    node.queued_prefill_tokens,
                    node.queued_prefill_tokens,
                    node.running,
                )
            )
        session_node = self._sessions.get(request.session) if request.session else None
        self._turn += 1
        choice = choose_node(candidates, prompt_tokens, session_node, self.policy, self._turn)
        assert choice is not None  # candidates is not empty
        node = next(node for node in ready if node.name == choice.node_id)
        node.sent(choice.new_prefill_tokens)
        if request.session:
            self._sessions[request.session] = node.name
            self._sessions.move_to_end(request.session)
            while len(self._sessions) > self.config.sessions:
                self._sessions.popitem(last=False)
        return Decision(node, choice, request.session, prompt_tokens, cached[node.name])

    def _prompter(self, node: NodeState) -> Prompter:
        info = node.info
        assert info is not None
        cached = self._node_prompters.get(node.name)
        if cached is not None and cached[0] is info:
            return cached[1]
        key = info.SerializeToString(deterministic=True)
        prompter = self._prompters.get(key)
        if prompter is None:
            prompter = self._prompters[key] = Prompter(info)
        self._node_prompters[node.name] = (info, prompter)
        return prompter
