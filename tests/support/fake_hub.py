"""A small Hugging Face Hub for tests, which cannot reach the real one: the HTTP endpoints that
huggingface_hub's HfApi calls to create a repo and a branch and commit files to it (regular files
inline, large ones through the LFS batch API's basic transfer), and those that ``snapshot_download``
reads them back through. Repos live in memory, as commits of whole trees on branches.

    hub = FakeHub(tokens={"hf_good"}).start()   # hub.url is its endpoint
    ...
    hub.stop()

What it checks, as the Hub does: a write needs a known token (401 otherwise), a private repo is
invisible without one (404), a commit goes to an existing branch (404 RevisionNotFound), an LFS
object is in the store before a commit names it, and its bytes match its sha256. Not served: pull
requests, Xet storage (a client sending open files uploads through LFS, as Loopline's trainer does),
pagination (one page), datasets and spaces.
"""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn
import yaml
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

# What the Hub's default .gitattributes sends through LFS; other files go there past this size.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".png", ".h5", ".msgpack", ".onnx")
LFS_MIN_BYTES = 10 << 20
GITATTRIBUTES = b"".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n".encode() for s in LFS_SUFFIXES)
LFS_POINTER_SIZE = 134


@dataclass
class Blob:
    content: bytes
    lfs: bool

    @property
    def oid(self) -> str:
        """What the Hub calls the file's oid: sha256 for LFS, the git blob sha1 otherwise."""
        if self.lfs:
            return hashlib.sha256(self.content).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(self.content) + self.content).hexdigest()


@dataclass
class Commit:
    sha: str
    summary: str
    tree: dict[str, Blob]


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # name -> commit sha
    commits: dict[str, Commit] = field(default_factory=dict)

    def resolve(self, revision: str) -> Commit | None:
        sha = self.branches.get(revision, revision)
        return self.commits.get(sha)

    def commit(self, branch: str, summary: str, tree: dict[str, Blob]) -> Commit:
        parent = self.branches.get(branch, "")
        listing = json.dumps(sorted((p, b.oid) for p, b in tree.items()))
        sha = hashlib.sha1(f"{parent}\n{summary}\n{listing}\n{time.time_ns()}".encode()).hexdigest()
        self.commits[sha] = Commit(sha, summary, dict(tree))
        self.branches[branch] = sha
        return self.commits[sha]


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, **body: object):
        super().__init__(message)
        self.status, self.message, self.code, self.body = status, message, code, body


class FakeHub:
    def __init__(self, tokens: set[str] | frozenset[str] = frozenset({"hf_test_token"}),
                 user: str = "tester"):
        self.tokens = set(tokens)
        self.user = user
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}
        self.calls: list[str] = []  # "METHOD /path" of every request, in order
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    # --- running ---------------------------------------------------------------------------------
    def start(self) -> FakeHub:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app(), log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake hub did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- what tests look at ----------------------------------------------------------------------
    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        commit = self.repos[repo_id].resolve(revision)
        assert commit is not None, f"{repo_id} has no revision {revision!r}"
        return {path: blob.content for path, blob in commit.tree.items()}

    # --- the Hub's rules -------------------------------------------------------------------------
    def _token(self, request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        if not header:
            return None
        token = header.removeprefix("Bearer ").strip()
        if token not in self.tokens:
            raise HubError(401, "Invalid credentials in Authorization header")
        return token

    def _repo(self, request: Request, repo_id: str, *, write: bool = False) -> Repo:
        token = self._token(request)
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and token is None):
            raise HubError(404, f"Repository Not Found for url: {request.url}", "RepoNotFound")
        if write and token is None:
            raise HubError(401, "You must be authenticated to write to a repo")
        return repo

    @staticmethod
    def _commit(repo: Repo, revision: str) -> Commit:
        commit = repo.resolve(revision)
        if commit is None:
            raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit

    def _upload_mode(self, path: str, size: int) -> str:
        return "lfs" if path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_BYTES else "regular"

    # --- endpoints -------------------------------------------------------------------------------
    def app(self) -> FastAPI:
        app = FastAPI()
        hub = self

        @app.middleware("http")
        async def note(request: Request, call_next):
            hub.calls.append(f"{request.method} {request.url.path}")
            return await call_next(request)

        @app.exception_handler(HubError)
        async def refused(request: Request, exc: HubError):
            headers = {"X-Error-Message": exc.message}
            if exc.code:
                headers["X-Error-Code"] = exc.code
            return JSONResponse({"error": exc.message, **exc.body}, status_code=exc.status, headers=headers)

        @app.post("/api/repos/create")
        async def create_repo(request: Request):
            if hub._token(request) is None:
                raise HubError(401, "You must be authenticated to create a repo")
            body = await request.json()
            if body.get("type") not in (None, "model"):
                raise HubError(400, "this hub holds model repos only")
            repo_id = f"{body.get('organization') or hub.user}/{body['name']}"
            if repo_id in hub.repos:
                # The Hub says where the repo is: create_repo(exist_ok=True) returns that.
                raise HubError(409, "You already created this model repo", url=f"{hub.url}/{repo_id}")
            repo = Repo(repo_id, private=body.get("visibility") == "private" or bool(body.get("private")))
            repo.commit("main", "initial commit", {".gitattributes": Blob(GITATTRIBUTES, lfs=False)})
            hub.repos[repo_id] = repo
            return {"url": f"{hub.url}/{repo_id}", "name": repo_id}

        @app.post("/api/validate-yaml")
        async def validate_yaml(request: Request):
            content = (await request.json())["content"]
            front = content.split("---\n")[1] if content.startswith("---\n") else ""
            try:
                if not isinstance(yaml.safe_load(front) or {}, dict):
                    raise yaml.YAMLError("metadata is not a mapping")
            except yaml.YAMLError as exc:
                return JSONResponse({"errors": [{"message": str(exc)}]}, status_code=400)
            return {"errors": [], "warnings": []}

        @app.post("/api/models/{ns}/{name}/branch/{branch}")
        async def create_branch(ns: str, name: str, branch: str, request: Request):
            repo = hub._repo(request, f"{ns}/{name}", write=True)
            if branch in repo.branches:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            body = await request.json() if await request.body() else {}
            start = hub._commit(repo, body.get("startingPoint") or "main")
            repo.branches[branch] = start.sha
            return {}

        @app.post("/api/models/{ns}/{name}/preupload/{revision}")
        async def preupload(ns: str, name: str, revision: str, request: Request):
            repo = hub._repo(request, f"{ns}/{name}", write=True)
            head = hub._commit(repo, revision)
            files = []
            for item in (await request.json())["files"]:
                known = head.tree.get(item["path"])
                mode = hub._upload_mode(item["path"], item["size"])
                files.append({"path": item["path"], "uploadMode": mode, "shouldIgnore": False,
                              "oid": known.oid if known else None})
            return {"files": files}

        @app.post("/{ns}/{name_git}/info/lfs/objects/batch")
        async def lfs_batch(ns: str, name_git: str, request: Request):
            hub._repo(request, f"{ns}/{name_git.removesuffix('.git')}", write=True)
            body = await request.json()
            if "basic" not in body.get("transfers", ["basic"]):
                raise HubError(400, "this hub speaks the basic LFS transfer only")
            objects = []
            for obj in body["objects"]:
                entry = {"oid": obj["oid"], "size": obj["size"]}
                if obj["oid"] not in hub.lfs:
                    entry["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{obj['oid']}"}}
                objects.append(entry)
            return {"transfer": "basic", "objects": objects}

        @app.put("/lfs-upload/{oid}")
        async def lfs_upload(oid: str, request: Request):
            data = await request.body()
            if hashlib.sha256(data).hexdigest() != oid:
                raise HubError(400, "the uploaded bytes do not match their sha256")
            hub.lfs[oid] = data
            return Response(status_code=200)

        @app.post("/api/models/{ns}/{name}/commit/{revision}")
        async def commit(ns: str, name: str, revision: str, request: Request):
            repo = hub._repo(request, f"{ns}/{name}", write=True)
            if request.query_params.get("create_pr"):
                raise HubError(400, "this hub does not open pull requests")
            tree = dict(hub._commit(repo, revision).tree)
            summary = ""
            for line in (await request.body()).splitlines():
                item = json.loads(line)
                key, value = item["key"], item["value"]
                if key == "header":
                    summary = value["summary"]
                elif key == "file":
                    tree[value["path"]] = Blob(base64.b64decode(value["content"]), lfs=False)
                elif key == "lfsFile":
                    if value["oid"] not in hub.lfs:
                        raise HubError(400, f"LFS object {value['oid']} was never uploaded")
                    tree[value["path"]] = Blob(hub.lfs[value["oid"]], lfs=True)
                elif key == "deletedFile":
                    tree.pop(value["path"], None)
                elif key == "deletedFolder":
                    folder = value["path"].rstrip("/") + "/"
                    tree = {p: b for p, b in tree.items() if not p.startswith(folder)}
                else:
                    raise HubError(400, f"unknown commit operation {key!r}")
            made = repo.commit(revision, summary, tree)
            return {"commitUrl": f"{hub.url}/{repo.repo_id}/commit/{made.sha}", "commitOid": made.sha,
                    "success": True}

        @app.get("/api/models/{ns}/{name}")
        @app.get("/api/models/{ns}/{name}/revision/{revision}")
        async def repo_info(ns: str, name: str, request: Request, revision: str = "main"):
            repo = hub._repo(request, f"{ns}/{name}")
            head = hub._commit(repo, revision)
            return {"id": repo.repo_id, "modelId": repo.repo_id, "sha": head.sha, "private": repo.private,
                    "siblings": [{"rfilename": p} for p in sorted(head.tree)]}

        @app.get("/api/models/{ns}/{name}/tree/{revision}")
        @app.get("/api/models/{ns}/{name}/tree/{revision}/{path:path}")
        async def tree(ns: str, name: str, revision: str, request: Request, path: str = ""):
            head = hub._commit(hub._repo(request, f"{ns}/{name}"), revision)
            recursive = request.query_params.get("recursive", "").lower() == "true"
            prefix = path.strip("/") + "/" if path.strip("/") else ""
            entries, folders = [], set()
            for file_path, blob in sorted(head.tree.items()):
                if not file_path.startswith(prefix):
                    continue
                rest = file_path[len(prefix):]
                parts = rest.split("/")
                for depth in range(1, len(parts)):
                    if recursive or depth == 1:
                        folders.add(prefix + "/".join(parts[:depth]))
                if len(parts) > 1 and not recursive:
                    continue
                entry = {"type": "file", "path": file_path, "size": len(blob.content), "oid": blob.oid}
                if blob.lfs:
                    entry["lfs"] = {"oid": blob.oid, "size": len(blob.content),
                                    "pointerSize": LFS_POINTER_SIZE}
                entries.append(entry)
            entries += [{"type": "directory", "path": f, "size": 0,
                         "oid": hashlib.sha1(f.encode()).hexdigest()} for f in sorted(folders)]
            return entries

        @app.api_route("/{ns}/{name}/resolve/{revision}/{path:path}", methods=["GET", "HEAD"])
        async def resolve(ns: str, name: str, revision: str, path: str, request: Request):
            head = hub._commit(hub._repo(request, f"{ns}/{name}"), revision)
            blob = head.tree.get(path)
            if blob is None:
                raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
            headers = {"X-Repo-Commit": head.sha, "ETag": f'"{blob.oid}"',
                       "Content-Length": str(len(blob.content))}
            if blob.lfs:
                headers.update({"X-Linked-Etag": f'"{blob.oid}"', "X-Linked-Size": str(len(blob.content))})
            body = b"" if request.method == "HEAD" else blob.content
            return Response(body, headers=headers, media_type="application/octet-stream")

        return app
