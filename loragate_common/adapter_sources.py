"""Where fetched adapters come from: source URIs, the allow-list an engine fetches under, and `fetch`.

A source is `s3://bucket/prefix` (boto3; endpoint, region and credentials from the AWS environment),
`hf://org/repo[@revision]` (huggingface_hub; HF_ENDPOINT, HF_TOKEN), `https://host/path/name.tar.gz` or
`http://...` (an archive: .tar, .tar.gz, .tgz, .zip; redirects are not followed), or a local directory
(an absolute path or `file:///path`). `fetch` writes exactly ADAPTER_FILES into a directory, never more than
`max_bytes` there, gives up past its deadline, and verifies the digest the catalog registered:

- s3, hf, local: the content digest, `sha256sum adapter_config.json adapter_model.safetensors | sha256sum`;
- https, http: the sha256 of the archive bytes, checked before anything is extracted.

URIs and archive member names are hostile input: parsing refuses control characters, `..` and `.`
segments, percent-encoded dots, slashes and backslashes, userinfo, non-DNS bucket names and empty repo
parts, and allow-list matching compares whole path segments of the normalised URI (`s3://b/team` allows
`s3://b/team/x`, never `s3://b/team-evil/x`; local paths after os.path.realpath). Nothing is unpickled:
a source with only pickled weights is refused with reason "pickle". No torch here: the CLI uses it too.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import ipaddress
import json
import lzma
import os
import re
import stat
import tarfile
import time
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import unquote

import httpx

from loragate_common.errors import shown

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
REASONS = frozenset(
    ("invalid", "not_allowed", "not_found", "unreachable", "timeout", "digest_mismatch", "too_large", "pickle")
    + ("bad_archive", "bad_adapter", "size_mismatch")
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
# Reads block until a whole chunk arrives (boto3's) or hand over what came (httpx's): the deadline is
# checked between chunks, so a slow source overshoots it by at most one chunk's time.
_CHUNK = 64 << 10
_MAX_URI = 2048
_MAX_MEMBERS = 10_000  # archive entries: past this an archive is refused (a CPU bomb, not an adapter)
_MAX_CONFIG_BYTES = 1 << 20
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own bound on a header
_ARCHIVE_PART = ".archive.part"  # the downloaded archive inside `dest`, removed once extracted
_S3_KEY_SEGMENT = re.compile(r"[A-Za-z0-9._~!*'()+=,@-]+")
_HTTP_SEGMENT = re.compile(r"(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})+")
_HF_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_HF_REVISION = re.compile(r"[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_DNS_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_HEX64 = re.compile(r"[0-9a-f]{64}")
# Percent-encodings that would smuggle a segment separator, a dot segment, a control character or a second
# round of decoding past the checks above.
_BAD_ESCAPE = re.compile(r"%(?:2[eEfF]|5[cC]|25|[01][0-9A-Fa-f]|7[fF])")
_DEFAULT_PORTS = {"https": 443, "http": 80}


class SourceError(ValueError):
    """A source could not be parsed, is not allowed, or could not be fetched; `reason` says which kind."""

    def __init__(self, reason: str, message: str = "") -> None:
        assert reason in REASONS, reason
        super().__init__(message or reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Source:
    """A parsed, normalised source; str(source) is its normalised URI."""

    kind: str  # "s3" | "hf" | "https" | "http" | "local"
    authority: str  # s3: the bucket; https/http: host[:port], without a default port; hf, local: ""
    path: str  # s3: key prefix; hf: "org/repo"; https/http: the path without its leading "/"; local: absolute
    revision: str | None = None  # hf: a branch, tag or commit (None: the default branch)
    query: str = ""  # https/http: kept as given (a signed URL's), never matched by the allow-list

    @property
    def shown(self) -> str:
        """The URI for messages and logs: a query (a signed URL's signature) is left out."""
        return str(self).partition("?")[0] + ("?..." if self.query else "")

    def __str__(self) -> str:
        if self.kind == "local":
            return self.path
        if self.kind == "hf":
            return f"hf://{self.path}" + (f"@{self.revision}" if self.revision else "")
        uri = f"{self.kind}://{self.authority}" + (f"/{self.path}" if self.path else "")
        return uri + (f"?{self.query}" if self.query else "")

    @property
    def segments(self) -> tuple[str, ...]:
        return tuple(self.path.split("/")) if self.path else ()


@dataclass(frozen=True, slots=True)
class Fetched:
    digest: str  # content digest of the two files
    archive_digest: str | None  # https/http: sha256 of the archive
    size: int  # bytes of the two files
    revision: str | None  # hf: the commit the revision resolved to


def _invalid(uri: str, why: str) -> SourceError:
    return SourceError("invalid", f"invalid adapter source {shown(uri)}: {why}")


def parse_source(uri: str) -> Source:
    """`uri` parsed and normalised; SourceError("invalid") for a malformed or hostile one."""
    return _parse(uri, prefix=False)


def _parse(uri: str, *, prefix: bool) -> Source:
    """A source, or (prefix=True) an allow-list prefix, which may stop short: `s3://bucket`, `hf://org`."""
    if not isinstance(uri, str) or not 0 < len(uri) <= _MAX_URI:
        raise _invalid(str(uri)[:100], f"a source is a string of 1 to {_MAX_URI} characters")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in uri):
        raise _invalid(uri, "control characters")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        if not uri.startswith("/"):
            raise _invalid(uri, "use s3://, hf://, https://, http://, file:// or an absolute local path")
        return Source("local", "", _local_path(uri, uri))
    scheme = scheme.lower()
    if scheme != "file" and any(not 0x20 < ord(c) < 0x7F or c == "\\" for c in rest):
        raise _invalid(uri, "spaces, backslashes and non-ASCII characters are not allowed")
    if scheme == "s3":
        return _parse_s3(uri, rest)
    if scheme == "hf":
        return _parse_hf(uri, rest, prefix)
    if scheme in ("https", "http"):
        return _parse_http(uri, scheme, rest, prefix)
    if scheme == "file":
        host, slash, path = rest.partition("/")
        if host not in ("", "localhost") or not slash:
            raise _invalid(uri, "a file:// URI names a local absolute path (file:///path)")
        if _BAD_ESCAPE.search(path):
            raise _invalid(uri, "percent-encoded dots, slashes or control characters")
        try:
            return Source("local", "", _local_path(uri, unquote("/" + path, errors="strict")))
        except UnicodeDecodeError:
            raise _invalid(uri, "percent-encoded bytes that are not UTF-8") from None
    raise _invalid(uri, f"unsupported scheme {scheme!r}")


def _segments(uri: str, path: str, pattern: re.Pattern[str], what: str) -> list[str]:
    """The '/'-separated segments of `path` (one trailing '/' allowed), each matching `pattern`."""
    parts = path.removesuffix("/").split("/") if path not in ("", "/") else []
    for part in parts:
        if part in ("", ".", ".."):
            raise _invalid(uri, f"empty, '.' or '..' segment in the {what}")
        if pattern.fullmatch(part) is None or _BAD_ESCAPE.search(part):
            raise _invalid(uri, f"unsupported characters in the {what} segment {shown(part)}")
    return parts


def _local_path(uri: str, path: str) -> str:
    if "\x00" in path or any(ord(c) < 0x20 for c in path):
        raise _invalid(uri, "control characters")
    parts = path.removesuffix("/").split("/")[1:] if path != "/" else []
    if any(part in ("", ".", "..") for part in parts):
        raise _invalid(uri, "empty, '.' or '..' segment in the path")
    return "/" + "/".join(parts)


def _parse_s3(uri: str, rest: str) -> Source:
    bucket, _, key = rest.partition("/")
    if _BUCKET.fullmatch(bucket) is None or ".." in bucket or ".-" in bucket or "-." in bucket:
        raise _invalid(uri, "the bucket must be a DNS-style name of 3 to 63 lowercase letters, digits, '.', '-'")
    if re.fullmatch(r"[0-9.]+", bucket):
        raise _invalid(uri, "the bucket must not look like an IP address")
    return Source("s3", bucket, "/".join(_segments(uri, key, _S3_KEY_SEGMENT, "key")))


def _parse_hf(uri: str, rest: str, prefix: bool) -> Source:
    repo, at, revision = rest.partition("@")
    parts = repo.removesuffix("/").split("/")
    if not (len(parts) == 2 or (prefix and len(parts) == 1 and not at)):
        raise _invalid(uri, "an hf source is hf://org/repo or hf://org/repo@revision")
    for part in parts:
        if _HF_NAME.fullmatch(part) is None or ".." in part or "--" in part or part.endswith((".", "-")):
            raise _invalid(uri, f"invalid Hub name {shown(part)} (letters, digits, '.', '_', '-')")
    if at and (_HF_REVISION.fullmatch(revision) is None or len(revision) > 256 or ".." in revision):
        raise _invalid(uri, "invalid revision (a branch, tag or commit)")
    return Source("hf", "", "/".join(parts), revision or None)


def _parse_http(uri: str, scheme: str, rest: str, prefix: bool) -> Source:
    if "#" in rest:
        raise _invalid(uri, "a fragment is not allowed")
    rest, _, query = rest.partition("?")
    if prefix and query:
        raise _invalid(uri, "an allowed prefix has no query")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        raise _invalid(uri, "credentials in the URL are not allowed")
    host, port = _host_port(uri, authority)
    if port is not None and port != _DEFAULT_PORTS[scheme]:
        host = f"{host}:{port}"
    parts = _segments(uri, path, _HTTP_SEGMENT, "path")
    if not prefix and (not parts or not parts[-1].lower().endswith(ARCHIVE_SUFFIXES)):
        raise _invalid(uri, f"an {scheme} source is an archive: {', '.join(ARCHIVE_SUFFIXES)}")
    return Source(scheme, host, "/".join(parts), None, query)


def _host_port(uri: str, authority: str) -> tuple[str, int | None]:
    if authority.startswith("["):
        host, bracket, port_text = authority[1:].partition("]")
        try:
            if not bracket:
                raise ValueError(host)
            host = f"[{ipaddress.IPv6Address(host).compressed}]"
        except ValueError:
            raise _invalid(uri, "invalid IPv6 address") from None
        if port_text and not port_text.startswith(":"):
            raise _invalid(uri, "invalid host")
        port_text = port_text[1:]
    else:
        host, _, port_text = authority.partition(":")
        host = host.lower()
        labels = host.split(".")
        if len(host) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in labels):
            raise _invalid(uri, "invalid host name")
    if not port_text:
        return host, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _invalid(uri, "invalid port")
    return host, int(port_text)


class AllowList:
    """The source prefixes an engine may fetch from; a source is allowed when it lies under one of them."""

    def __init__(self, prefixes: Sequence[str]) -> None:
        self._prefixes = tuple(_parse(prefix, prefix=True) for prefix in prefixes)

    @property
    def prefixes(self) -> tuple[str, ...]:
        return tuple(str(prefix) for prefix in self._prefixes)

    def allows(self, source: Source) -> bool:
        return any(_under(source, prefix) for prefix in self._prefixes)

    def check(self, source: Source) -> None:
        if not self.allows(source):
            allowed = ", ".join(self.prefixes) or "none"
            raise SourceError("not_allowed", f"source {shown(source.shown)} is not under an allowed prefix ({allowed})")


def _under(source: Source, prefix: Source) -> bool:
    """Whether `source` lies under `prefix`, compared segment by segment (never mid-segment)."""
    if source.kind != prefix.kind or source.authority != prefix.authority:
        return False
    if source.kind == "local":
        path, root = os.path.realpath(source.path), os.path.realpath(prefix.path)
        return path == root or path.startswith(root.rstrip("/") + "/")
    if source.segments[: len(prefix.segments)] != prefix.segments:
        return False
    return prefix.revision is None or (source.revision or "main") == prefix.revision


class _Budget:
    """Bytes written so far against `max_bytes`, and the deadline every download checks between chunks."""

    def __init__(self, max_bytes: int, deadline_s: float) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        self.deadline_s = deadline_s
        self._deadline = time.monotonic() + deadline_s

    def left_s(self) -> float:
        """Seconds left; SourceError("timeout") when none are."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise SourceError("timeout", f"the download took longer than {self.deadline_s:g} s")
        return left

    def take(self, nbytes: int, what: str) -> None:
        self.used += nbytes
        if self.used > self.max_bytes:
            raise SourceError("too_large", f"{what}: more than the {self.max_bytes} bytes allowed for one adapter")

    def write(self, chunks: Iterable[bytes], path: Path, what: str) -> int:
        """Write `chunks` to a new file at `path`, counting every byte and checking the deadline."""
        written = 0
        with open(path, "xb") as out:
            for chunk in chunks:
                self.left_s()
                self.take(len(chunk), what)
                out.write(chunk)
                written += len(chunk)
        return written


def fetch(
    source: Source, dest: Path, *, sha256: str | None, size: int | None, max_bytes: int, deadline_s: float
) -> Fetched:
    """Write the adapter's two files into `dest` (an existing, empty directory) and verify them.

    `sha256` is the registered digest (the archive's for https/http, the content digest otherwise; None: not
    checked), `size` the registered bytes of the two files (None: not checked). On any failure `dest` is
    left empty. An archive is downloaded into `dest` (at most `max_bytes`) and removed once extracted.
    """
    if any(dest.iterdir()):
        raise ValueError(f"{dest} is not empty")
    if sha256 is not None and _HEX64.fullmatch(sha256) is None:
        raise SourceError("invalid", f"sha256 must be 64 lowercase hex digits, got {shown(sha256)}")
    if size is not None and size > max_bytes:
        raise SourceError("too_large", f"{size} bytes: more than the {max_bytes} bytes allowed for one adapter")
    budget = _Budget(max_bytes, deadline_s)
    archive_digest = revision = None
    try:
        if source.kind == "s3":
            _fetch_s3(source, dest, budget)
        elif source.kind == "hf":
            revision = _fetch_hf(source, dest, budget)
        elif source.kind in ("https", "http"):
            archive_digest = _fetch_archive(source, dest, budget, sha256)
        else:
            _fetch_local(source, dest, budget)
        digest = content_digest(dest)
        if sha256 is not None and archive_digest is None and digest != sha256:
            raise SourceError("digest_mismatch", f"{source.shown}: expected sha256 {sha256}, got {digest}")
        got = sum((dest / name).stat().st_size for name in ADAPTER_FILES)
        if size is not None and got != size:
            raise SourceError("size_mismatch", f"{source.shown}: expected {size} bytes, got {got}")
        check_adapter_files(dest)
    except BaseException:
        for child in dest.iterdir():
            child.unlink()
        raise
    return Fetched(digest, archive_digest, got, revision)


def content_digest(directory: Path) -> str:
    """sha256 of what `sha256sum adapter_config.json adapter_model.safetensors` prints in `directory`."""
    lines = "".join(f"{_sha256_file(directory / name)}  {name}\n" for name in ADAPTER_FILES)
    return hashlib.sha256(lines.encode()).hexdigest()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _missing(where: str, names: Iterable[str]) -> SourceError:
    """Why `names` (the files found) do not make an adapter: pickled weights only, or files missing."""
    names = set(names)
    if ADAPTER_FILES[1] not in names and any(name.endswith(PICKLE_SUFFIXES) for name in names):
        return SourceError("pickle", f"{where} has only pickled weights; convert them to adapter_model.safetensors")
    missing = [name for name in ADAPTER_FILES if name not in names]
    return SourceError("not_found", f"{where} has no {' and no '.join(missing)}")


def _check_listing(source: Source, sizes: Mapping[str, int | None], budget: _Budget) -> None:
    """Before downloading: the listed files hold the two adapter files, and their sizes fit the budget."""
    if not set(ADAPTER_FILES) <= sizes.keys():
        raise _missing(source.shown, sizes)
    if (total := sum(sizes[name] or 0 for name in ADAPTER_FILES)) > budget.max_bytes:
        raise SourceError("too_large", f"{source.shown}: {total} bytes, more than the {budget.max_bytes} allowed")


def check_adapter_files(directory: Path) -> None:
    """SourceError("bad_adapter") unless the config is a JSON object and the safetensors header parses
    (8-byte little-endian length, a JSON object of tensors whose offsets lie in the file);
    SourceError("pickle") when only pickled weights are there."""
    names = set(os.listdir(directory))
    if not set(ADAPTER_FILES) <= names:
        error = _missing(str(directory), names)
        raise error if error.reason == "pickle" else SourceError("bad_adapter", str(error))
    config_path, weights_path = (directory / name for name in ADAPTER_FILES)
    try:
        if config_path.stat().st_size > _MAX_CONFIG_BYTES:
            raise ValueError(f"larger than {_MAX_CONFIG_BYTES} bytes")
        if not isinstance(json.loads(config_path.read_bytes()), dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise SourceError("bad_adapter", f"adapter_config.json: {exc}") from None
    try:
        _check_safetensors(weights_path)
    except ValueError as exc:
        raise SourceError("bad_adapter", f"adapter_model.safetensors: {exc}") from None


def _check_safetensors(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < header_len <= min(size - 8, _MAX_HEADER_BYTES):
            raise ValueError("no safetensors header")
        header = json.loads(f.read(header_len))
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    data_len = size - 8 - header_len
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) else None
        shape = tensor.get("shape") if isinstance(tensor, dict) else None
        if (
            not isinstance(tensor, dict)
            or not isinstance(tensor.get("dtype"), str)
            or not isinstance(shape, list)
            or not all(isinstance(dim, int) and dim >= 0 for dim in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_len
        ):
            raise ValueError(f"bad entry for tensor {shown(str(name))}")


def _fetch_local(source: Source, dest: Path, budget: _Budget) -> None:
    root = Path(source.path)
    if not root.is_dir():
        raise SourceError("not_found", f"{source.shown} is not a directory")
    names = os.listdir(root)
    if not set(ADAPTER_FILES) <= set(names):
        raise _missing(source.shown, names)
    for name in ADAPTER_FILES:
        # Checked before opening too: opening a FIFO would block.
        if not stat.S_ISREG(os.stat(root / name).st_mode):
            raise SourceError("bad_adapter", f"{source.shown}/{name} is not a regular file")
        with open(root / name, "rb") as src:
            if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
                raise SourceError("bad_adapter", f"{source.shown}/{name} is not a regular file")
            budget.write(_read_chunks(src), dest / name, f"{source.shown}/{name}")


def _fetch_s3(source: Source, dest: Path, budget: _Budget) -> None:
    """List the prefix (only objects directly under it) and download the two files with boto3."""
    from botocore.exceptions import BotoCoreError, ClientError

    budget.left_s()
    client = _s3_client(budget.deadline_s, tuple(os.environ.get(name) for name in _AWS_ENV))
    key_prefix = f"{source.path}/" if source.path else ""
    try:
        sizes: dict[str, int] = {}
        pages = client.get_paginator("list_objects_v2").paginate(
            Bucket=source.authority, Prefix=key_prefix, Delimiter="/", PaginationConfig={"MaxItems": _MAX_MEMBERS}
        )
        for page in pages:
            budget.left_s()
            for obj in page.get("Contents", []):
                sizes[obj["Key"][len(key_prefix) :]] = int(obj["Size"])
        _check_listing(source, sizes, budget)
        for name in ADAPTER_FILES:
            body = client.get_object(Bucket=source.authority, Key=key_prefix + name)["Body"]
            with body:
                budget.write(body.iter_chunks(_CHUNK), dest / name, f"{source.shown}/{name}")
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code, message = str(error.get("Code", "")), error.get("Message", "")
        if code in ("NoSuchBucket", "NoSuchKey", "404", "NotFound"):
            raise SourceError("not_found", f"{source.shown}: {code} {message}".rstrip()) from None
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise SourceError("not_found", f"{source.shown}: access denied ({code})") from None
        raise SourceError("unreachable", f"{source.shown}: {code} {message}".rstrip()) from None
    except BotoCoreError as exc:
        raise _from_botocore(source, exc) from None


# The environment a boto3 client is built from: a change to any of these builds a new one.
_AWS_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)


@functools.lru_cache(maxsize=8)
def _s3_client(deadline_s: float, env: tuple[str | None, ...]) -> Any:
    """One boto3 S3 client per fetch deadline and AWS environment (`env`: the values of _AWS_ENV, the cache
    key), shared by every download: building one costs ~80 ms of CPU, more than fetching a small adapter.
    boto3 clients are thread-safe; their credentials refresh themselves (e.g. web identity tokens)."""
    import boto3
    from botocore.config import Config

    config = Config(
        connect_timeout=min(10.0, deadline_s),
        read_timeout=min(60.0, deadline_s),
        retries={"total_max_attempts": 2, "mode": "standard"},
    )
    return boto3.session.Session().client("s3", config=config)


def _from_botocore(source: Source, exc: Exception) -> SourceError:
    from botocore.exceptions import ConnectTimeoutError, NoCredentialsError, ReadTimeoutError

    if isinstance(exc, ConnectTimeoutError | ReadTimeoutError):
        return SourceError("timeout", f"{source.shown}: {exc}")
    if isinstance(exc, NoCredentialsError):
        return SourceError("unreachable", f"{source.shown}: no AWS credentials (AWS_ACCESS_KEY_ID, ...)")
    return SourceError("unreachable", f"{source.shown}: {exc}")


def _fetch_hf(source: Source, dest: Path, budget: _Budget) -> str:
    """Resolve the revision to a commit (with file sizes) through the Hub API, then download the two files of
    that commit. Returns the commit."""
    import httpx2
    from huggingface_hub import HfApi, hf_hub_url
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import build_hf_headers

    # Read at call time: huggingface_hub reads HF_ENDPOINT once, when it is imported.
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    try:
        info = HfApi(endpoint=endpoint).model_info(
            source.path, revision=source.revision, files_metadata=True, timeout=min(30.0, budget.left_s())
        )
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as exc:
        raise SourceError("not_found", f"{source.shown}: {type(exc).__name__}") from None
    except HfHubHTTPError as exc:
        raise SourceError("unreachable", f"{source.shown}: {str(exc).splitlines()[0]}") from None
    except httpx2.TimeoutException:
        raise SourceError("timeout", f"{source.shown}: the Hub did not answer in time") from None
    except (httpx2.HTTPError, OSError) as exc:
        raise SourceError("unreachable", f"{source.shown}: {exc}") from None
    if info.sha is None:
        raise SourceError("unreachable", f"{source.shown}: the Hub did not say which commit it resolved to")
    _check_listing(source, {sibling.rfilename: sibling.size for sibling in info.siblings or []}, budget)
    headers = build_hf_headers()
    # The Hub answers a file of a large repo with a redirect to its CDN: followed here (and only here).
    with httpx.Client(follow_redirects=True, headers=headers) as client:
        for name in ADAPTER_FILES:
            url = hf_hub_url(source.path, name, revision=info.sha, endpoint=endpoint)
            _download(client, url, dest / name, budget, f"{source.shown}/{name}")
    return info.sha


def _fetch_archive(source: Source, dest: Path, budget: _Budget, sha256: str | None) -> str:
    """Download the archive (redirects not followed), verify its digest, extract the two files. Returns the
    archive's sha256."""
    archive = dest / _ARCHIVE_PART
    with httpx.Client(follow_redirects=False) as client:
        digest = _download(client, str(source), archive, budget, source.shown)
    if sha256 is not None and digest != sha256:
        raise SourceError("digest_mismatch", f"{source.shown}: expected archive sha256 {sha256}, got {digest}")
    extracted = _Budget(budget.max_bytes, budget.left_s())
    try:
        if source.path.lower().endswith(".zip"):
            _extract_zip(archive, dest, extracted, source.shown)
        else:
            _extract_tar(archive, dest, extracted, source.shown)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, gzip.BadGzipFile, lzma.LZMAError) as exc:
        raise SourceError("bad_archive", f"{source.shown}: {exc}") from None
    finally:
        archive.unlink()
    return digest


def _download(client: httpx.Client, url: str, path: Path, budget: _Budget, what: str) -> str:
    """Stream `url` into a new file at `path` within the budget; returns the sha256 of the bytes."""
    digest = hashlib.sha256()
    left = budget.left_s()
    timeout = httpx.Timeout(min(30.0, left), connect=min(10.0, left))
    try:
        # identity: the bytes as stored (an archive's digest is of those); a server that encodes anyway is
        # decoded, and the decoded bytes are what the budget counts.
        with client.stream("GET", url, timeout=timeout, headers={"Accept-Encoding": "identity"}) as response:
            _check_status(response, what)
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > budget.max_bytes - budget.used:
                raise SourceError("too_large", f"{what}: {length} bytes, more than allowed for one adapter")
            budget.write(_hashed(response.iter_bytes(), digest.update), path, what)
    except httpx.TimeoutException:
        raise SourceError("timeout", f"{what}: no answer within the download's time limit") from None
    except httpx.ConnectError as exc:
        raise SourceError("unreachable", f"{what}: cannot connect ({exc})") from None
    except httpx.HTTPError as exc:
        raise SourceError("unreachable", f"{what}: the download broke off ({exc})") from None
    return digest.hexdigest()


def _hashed(chunks: Iterator[bytes], update: Callable[[bytes], None]) -> Iterator[bytes]:
    for chunk in chunks:
        update(chunk)
        yield chunk


def _check_status(response: httpx.Response, what: str) -> None:
    status = response.status_code
    if status == 200:
        return
    if 300 <= status < 400:
        location = shown(response.headers.get("Location", ""))
        raise SourceError("invalid", f"{what}: redirected to {location}; redirects are not followed")
    if status in (401, 403):
        raise SourceError("not_found", f"{what}: access denied (HTTP {status})")
    if status in (404, 410):
        raise SourceError("not_found", f"{what}: HTTP {status}")
    raise SourceError("unreachable", f"{what}: HTTP {status}")


def _member_parts(name: str, what: str) -> tuple[str, ...]:
    """An archive member's path segments ('.' segments dropped); bad_archive for absolute names, '..',
    backslashes and control characters."""
    if name.startswith("/") or "\\" in name or any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise SourceError("bad_archive", f"{what}: unsafe member name {shown(name)}")
    parts = tuple(part for part in name.split("/") if part not in ("", "."))
    if ".." in parts:
        raise SourceError("bad_archive", f"{what}: unsafe member name {shown(name)}")
    return parts


class _Members:
    """Walks an archive's members in order: refuses duplicates and anything but files and folders, and
    picks the adapter files at the top or inside one top-level folder."""

    def __init__(self, what: str, max_bytes: int) -> None:
        self.what = what
        self.max_bytes = max_bytes
        self.declared = 0
        self.count = 0
        self.seen: set[tuple[str, ...]] = set()  # files, by their path segments
        self.folder: tuple[str, ...] | None = None  # where the adapter files are: () or (top,)
        self.names: set[str] = set()  # regular files at depth 1 or 2: pickles are reported by name

    def adapter_file(self, name: str, is_dir: bool, is_file: bool, size: int) -> str | None:
        """The adapter file this member is, if it is one; raises for a member no adapter archive holds."""
        parts = _member_parts(name, self.what)
        self.count += 1
        if self.count > _MAX_MEMBERS:
            raise SourceError("bad_archive", f"{self.what}: more than {_MAX_MEMBERS} members")
        if is_dir:
            return None
        if not is_file or not parts:
            raise SourceError("bad_archive", f"{self.what}: {shown(name)} is a link or special file")
        if parts in self.seen:
            raise SourceError("bad_archive", f"{self.what}: duplicate member {shown(name)}")
        self.seen.add(parts)
        self.declared += size
        if self.declared > self.max_bytes:
            raise SourceError("too_large", f"{self.what}: more than {self.max_bytes} bytes uncompressed")
        if len(parts) > 2 or parts[-1] not in ADAPTER_FILES:
            self.names.update(parts[-1:] if len(parts) <= 2 else ())
            return None
        if self.folder is not None and self.folder != parts[:-1]:
            raise SourceError("bad_archive", f"{self.what}: adapter files in two folders")
        self.folder = parts[:-1]
        self.names.add(parts[-1])
        return parts[-1]

    def done(self) -> None:
        if not set(ADAPTER_FILES) <= self.names:
            error = _missing(self.what, self.names)
            raise error if error.reason == "pickle" else SourceError("bad_archive", str(error))


def _extract_tar(archive: Path, dest: Path, budget: _Budget, what: str) -> None:
    members = _Members(what, budget.max_bytes)
    with tarfile.open(archive, "r|*") as tar:  # sequential: no seeking back, any compression tarfile knows
        for member in tar:
            budget.left_s()
            name = members.adapter_file(member.name, member.isdir(), member.isreg(), member.size)
            src = tar.extractfile(member) if name is not None else None
            if name is not None and src is not None:
                budget.write(_read_chunks(src), dest / name, f"{what}: {name}")
    members.done()


def _extract_zip(archive: Path, dest: Path, budget: _Budget, what: str) -> None:
    members = _Members(what, budget.max_bytes)
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            budget.left_s()
            mode = info.external_attr >> 16
            kind = stat.S_IFMT(mode)
            is_dir = info.is_dir() and kind in (0, stat.S_IFDIR)
            is_file = not info.is_dir() and kind in (0, stat.S_IFREG)
            name = members.adapter_file(info.filename, is_dir, is_file, info.file_size)
            if name is not None:
                if info.flag_bits & 0x1:
                    raise SourceError("bad_archive", f"{what}: {name} is encrypted")
                with zf.open(info) as src:
                    budget.write(_read_chunks(src), dest / name, f"{what}: {name}")
    members.done()


def _read_chunks(src: IO[bytes]) -> Iterator[bytes]:
    while chunk := src.read(_CHUNK):
        yield chunk
