"""The web dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright):
a first visit is asked for a token (a refused one is told so), a job submitted through the API
shows up, its loss curve grows while it trains, a worker SIGKILL shows as RECOVERING and then
RUNNING and is marked on the curves where it happened, the page's cancel button cancels it,
a cancelled and a failed job look different, a job with a long log shows its end, and the
nodes page shows GPUs as the CLI does, drains a node and undrains it.

RECOVERING is asserted on the job's events timeline, where the page lists it: on a worker
SIGKILL the job is RECOVERING from the fault until the new group's first step (a second or
two here), which a page that polls once a second may not catch in its state badge. The
timeline shows the group forming while still RECOVERING, then RUNNING at a step it names.

The browser is the system's: nothing downloads one (`apt-get install chromium`; `make
setup` and .ci/run install it). Every request the page makes to another host is refused,
so the dashboard and /docs are shown to work with no Internet access.

With FTRAIN_SCREENSHOTS=<dir> the tests save the jobs page and the job page there (the
screenshots in docs/ come from them), and the ended jobs and a resized job's page.

tests/integration/test_dashboard_marks.py checks the marks' placement for every cause, in Node.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

import pytest

from service.cli import _gpus_cell
from tests.helpers.elastic import events, job, job_spec, log_items, submit, wait_state
from tests.helpers.faults import train_spec, wait_workers
from tests.helpers.processes import REPO, pid_alive, wait_for

sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (the test extra)")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")

TIMEOUT_MS = 30_000


def points(page, chart: str) -> int:
    """The points the page's chart `chart` has drawn (uPlot's data, as the page set it)."""
    return int(page.get_attribute(f'[data-chart="{chart}"]', "data-points") or 0)


def wait_points(page, more_than: int) -> None:
    """Wait until the page's loss curve has more than `more_than` points."""
    loss = "document.querySelector('[data-chart=\"loss\"]')"
    page.wait_for_function(f"() => +{loss}.dataset.points > {more_than}")


def step_at(history: dict, time: float) -> int | None:
    """The step of the history's newest point at or before `time` (where a mark belongs)."""
    before = [step for step, t in zip(history["steps"], history["times"]) if t <= time]
    return before[-1] if before else None


def marks(page, chart: str) -> list[dict]:
    """The regroup marks on the page's chart `chart`: their kind, step and title."""
    return page.eval_on_selector_all(
        f'[data-chart="{chart}"] .mark',
        "els => els.map(e => ({kind: e.dataset.kind, step: +e.dataset.step, title: e.title}))")


def badge_look(page, selector: str) -> dict:
    """How a state badge looks: its classes, its text (sign and name) and its colours."""
    page.wait_for_selector(selector)
    return page.eval_on_selector(selector, """el => { const s = getComputedStyle(el);
        return {cls: el.className, text: el.textContent, bg: s.backgroundColor, fg: s.color,
                border: s.borderTopColor}; }""")


def timeline(page) -> list[str]:
    """The states of the events timeline on the page, oldest first."""
    newest_first = page.eval_on_selector_all("#events li", "els => els.map(e => e.dataset.eventState)")
    return newest_first[::-1]


@contextlib.contextmanager
def dashboard(control_plane):
    """A page in headless Chromium that may reach the control plane only, accepts every
    "are you sure?", and at the end has asked no other host and had nothing refused by the
    page's Content-Security-Policy."""
    outside: list[str] = []  # requests the page tried to make to another host
    refused: list[str] = []  # what the page's Content-Security-Policy refused (the console says)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            context = browser.new_context(viewport={"width": 1360, "height": 1000})

            def offline(route):
                if route.request.url.startswith(control_plane.url):
                    return route.continue_()
                outside.append(route.request.url)
                return route.abort()

            context.route("**/*", offline)
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            page.on("dialog", lambda dialog: dialog.accept())  # the cancel button's "are you sure?"
            page.on("console", lambda msg: "Content Security Policy" in msg.text
                    and refused.append(msg.text))
            yield page
        finally:
            browser.close()
    assert outside == [], f"the pages asked other hosts for {outside}"
    assert refused == [], f"the dashboard's policy refused its own {refused}"


def sign_in(page, control_plane) -> None:
    page.goto(control_plane.url + "/ui/")
    page.fill("#token", control_plane.user_token)
    page.click("#signin button")
    page.wait_for_selector("#jobs")


def test_dashboard_follows_a_job_through_a_worker_sigkill_and_cancels_it(control_plane, api, agents,
                                                                           tmp_path):
    (agent,) = agents(1)
    shots = os.environ.get("FTRAIN_SCREENSHOTS")
    with dashboard(control_plane) as page:
        # / leads to the dashboard, which asks for a token before it shows anything
        answer = page.goto(control_plane.url + "/")
        assert page.url == control_plane.url + "/ui/"
        # under a policy that runs its own files only, and that no other site may frame
        assert "script-src 'self'" in answer.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]
        # a first visit is asked for a token, and told where one comes from: nothing refused yet
        prompt = page.inner_text("#signin")
        assert page.inner_text("#signin-error") == "" and "not accepted" not in prompt, prompt
        assert "ftrain users add NAME" in prompt, prompt
        # a token kept in the tab that the server refuses is said to be refused
        page.evaluate("sessionStorage.setItem('ftrain.token', 'a-revoked-token')")
        page.reload()
        page.wait_for_selector("#signin-error:has-text('Your token was not accepted')")
        page.fill("#token", "not-the-token")
        page.click("#signin button")
        page.wait_for_selector("#signin-error:text-is('That token was not accepted.')")
        page.fill("#token", control_plane.user_token)
        page.click("#signin button")
        page.wait_for_selector("#jobs")
        assert page.evaluate("sessionStorage.getItem('ftrain.token')") == control_plane.user_token

        others = []
        if shots:  # a fuller jobs page for the picture: a job that ended, one that waits
            others.append(submit(api, train_spec("warm-up", 20, every=10, delay_s=0.01)))
            wait_state(api, others[-1], "SUCCEEDED", 60)
            others.append(submit(api, train_spec("needs-two-nodes", 100, mn=2, mx=2)))

        # a job submitted through the API appears on the jobs page, with its progress
        spec = train_spec("dash", 600, every=10, delay_s=0.05)
        # the script by its path in the repository (the job's page shows the command)
        spec["command"][1], spec["working_dir"] = "examples/train.py", str(REPO)
        job_id = submit(api, spec)
        row = f'tr[data-job="{job_id}"]'
        page.wait_for_selector(f'{row} [data-state="RUNNING"]')
        page.wait_for_selector(f"{row} [data-progress]:has-text('ETA')")
        label = page.inner_text(f"{row} [data-progress]")
        assert "/ 600" in label and "%" in label, label
        if shots:
            page.wait_for_selector(f'tr[data-job="{others[-1]}"]')
            box = page.locator("main").bounding_box()
            page.screenshot(path=str(Path(shots) / "dashboard-jobs.png"),
                            clip={"x": 0, "y": 0, "width": 1360, "height": box["y"] + box["height"]})
            api.post(f"/v1/jobs/{others[-1]}/cancel").raise_for_status()

        # its page: the loss curve grows while it trains
        page.click(f"{row} a")
        page.wait_for_selector("#job-state [data-state='RUNNING']")
        wait_points(page, 1)
        before = points(page, "loss")
        wait_points(page, before)
        assert points(page, "samples_per_s") > before
        page.wait_for_selector("#log:has-text('step=')")  # the log follows the workers' output
        page.wait_for_selector("#snapshots td:has-text('latest')")
        assert page.is_visible("#chart-others") and "lr" in page.inner_text("#others-panel")

        # a worker SIGKILL: the page shows RECOVERING, then RUNNING again, and the curve goes on
        (victim,) = wait_workers(agent, 1)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: not pid_alive(victim), 10, "the SIGKILLed worker to die")
        page.wait_for_function("() => [...document.querySelectorAll('#events li')]"
                               ".some(li => li.dataset.eventState === 'RECOVERING')")
        page.wait_for_function("() => { const s = [...document.querySelectorAll('#events li')]"
                               ".map(li => li.dataset.eventState); "
                               "return s.indexOf('RUNNING') < s.indexOf('RECOVERING'); }")  # newest first
        states = timeline(page)
        recovering = states.index("RECOVERING")  # the fault; then the group's forming, the restore point
        assert "RUNNING" in states[recovering + 1:], states
        # RUNNING again only at the new group's first step, after it formed (RECOVERING)
        shown = page.eval_on_selector_all(
            "#events li", "els => els.map(e => [e.dataset.eventState, e.textContent])")[::-1]
        back = next(i for i, (state, _) in enumerate(shown) if state == "RUNNING" and i > recovering)
        assert "training again: world size 1 on 1 node(s), step " in shown[back][1], shown
        assert any(state == "RECOVERING" and "group formed:" in text
                   for state, text in shown[recovering:back]), \
            [(st, " ".join(t.split())[:100]) for st, t in shown]
        page.wait_for_selector("#job-state [data-state='RUNNING']")
        after = points(page, "loss")
        wait_points(page, after)
        assert job(api, job_id)["restarts"] == 1
        # the job's page counts its restarts by cause: one failure (the SIGKILL)
        page.wait_for_selector("#facts [data-restarts] [data-cause='failure']")
        assert page.inner_text("#facts [data-restarts]") == "1 (1 failure)"
        # where its time went, as a bar on its page: training, and the recovery among its parts
        page.wait_for_selector("#goodput .goodput-bar [data-cause='recovering']")
        shown = page.eval_on_selector_all("#goodput .goodput-bar [data-cause]",
                                          "els => els.map(e => e.dataset.cause)")
        assert {"waiting", "starting", "training", "recovering"} <= set(shown), shown
        assert "recovering" in page.inner_text("#goodput .goodput-key")

        # the restart is marked on both curves, at the step where the group stopped (the
        # history's newest point when the job went RECOVERING), its title naming the cause
        fault = next(e for e in events(api, job_id) if e["state"] == "RECOVERING")
        for chart in ("loss", "samples_per_s"):
            page.wait_for_selector(f'[data-chart="{chart}"] .mark.restart')
            wait_for(lambda: [m["step"] for m in marks(page, chart)] == [
                step_at(api.get(f"/v1/jobs/{job_id}/metrics").json(), fault["time"])], 30,
                f"the {chart} chart's one mark at the step where the job went RECOVERING")
            (mark,) = marks(page, chart)
            assert mark["kind"] == "restart" and fault["reason"] in mark["title"], mark
            assert mark["title"].startswith(f"restart at step {mark['step']}"), mark
            assert "restart" in page.inner_text(f'[data-chart="{chart}"] .mark-key')
        if shots:
            wait_points(page, after + 12)  # a longer curve for the picture in docs/
            page.screenshot(path=str(Path(shots) / "dashboard-job.png"), full_page=True)

        # cancel from the page
        page.click("#cancel")
        page.wait_for_selector("#job-state [data-state='CANCELLED']")
        assert job(api, job_id)["state"] == "CANCELLED"
        assert page.is_hidden("#cancel")

        # a job with a long log: its page starts the log near the end, and says so
        burst = submit(api, job_spec("burst", "--lines", "600", "--chars", "1000", mn=1, mx=1,
                                     script=REPO / "tests" / "scripts" / "print_burst.py"))
        wait_state(api, burst, "SUCCEEDED", 60)
        wait_for(lambda: any(i["line"].startswith("burst 599 ") for i in log_items(api, burst)), 30,
                 "the burst's last line in its log")
        page.goto(f"{control_plane.url}/ui/#/jobs/{burst}")
        page.wait_for_selector("#log:has-text('burst 599 ')")
        shown = page.inner_text("#log")
        assert "earlier output not shown" in shown and "burst 0 " not in shown
        assert page.is_hidden("#cancel")

        # a failed job and a cancelled one differ in sign, colour and fill, not colour alone,
        # and each looks the same in the jobs list as on its own page
        failed = submit(api, job_spec("fails", "3", mn=1, mx=1, max_restarts=0,
                                      script=REPO / "tests" / "scripts" / "exit_with.py"))
        wait_state(api, failed, "FAILED", 60)
        looks = {}
        for state, jid in (("FAILED", failed), ("CANCELLED", job_id)):
            page.click("a[data-nav='jobs']")
            looks[state] = badge_look(page, f'tr[data-job="{jid}"] [data-state="{state}"]')
            page.click(f'tr[data-job="{jid}"] a')
            assert badge_look(page, f"#job-state [data-state='{state}']") == looks[state]
        fail, cancel = looks["FAILED"], looks["CANCELLED"]
        assert fail["cls"] != cancel["cls"] and fail["bg"] != cancel["bg"], looks
        assert fail["text"][0] != cancel["text"][0] and fail["text"][0] not in "FC", looks  # the sign
        # and the list says why the failed one failed
        page.click("a[data-nav='jobs']")
        # above it, where every job's time went, added up
        page.wait_for_selector("#goodput-totals .goodput-bar [data-cause='recovering']")
        assert "all jobs: " in page.inner_text("#goodput-jobs")
        assert "max_restarts=0" in page.inner_text(f'tr[data-job="{failed}"] [data-why]')
        if shots:
            page.screenshot(path=str(Path(shots) / "dashboard-ended-jobs.png"))

        # the nodes page: n0, free again, and drained from the page (the admin's token)
        page.click("a[data-nav='nodes']")
        page.wait_for_selector('tr[data-node="n0"] [data-state="READY"]')
        assert page.inner_text('tr[data-node="n0"]').count("idle") == 1
        # its GPUs as `ftrain nodes` writes them (a node without any: "-")
        (n0,) = api.get("/v1/nodes").json()["items"]
        assert page.inner_text('tr[data-node="n0"] [data-gpus]') == _gpus_cell(n0) == "-"
        page.click('tr[data-node="n0"] button[data-drain="n0"]')
        page.wait_for_selector('tr[data-node="n0"] [data-state="DRAINED"]')
        assert api.get("/v1/nodes").json()["items"][0]["state"] == "DRAINED"  # idle
        page.click('tr[data-node="n0"] button[data-undrain="n0"]')  # and back in service
        page.wait_for_selector('tr[data-node="n0"] [data-state="READY"]')
        assert api.get("/v1/nodes").json()["items"][0]["state"] == "READY"

        # a job that does not exist: the page says so (and what retention keeps)
        page.goto(f"{control_plane.url}/ui/#/jobs/no-such-job")
        page.wait_for_selector("#banner:has-text('job no-such-job not found')")

        # /docs: Swagger UI from the package's own files
        page.goto(control_plane.url + "/docs")
        page.wait_for_selector(".swagger-ui .info .title:has-text('ftrain')")

    # what the control plane's Prometheus metrics saw of it
    text = api.get("/metrics").text
    got = {name: float(value) for name, _, value in
           (line.rpartition(" ") for line in text.splitlines() if line and not line.startswith("#"))}
    assert got['ftrain_jobs{state="CANCELLED"}'] == 1 + (1 if shots else 0)
    assert got['ftrain_jobs{state="FAILED"}'] == 1
    assert got["ftrain_job_restarts_total"] == 1 and got["ftrain_job_recovery_seconds_count"] == 1
    assert 0 < got["ftrain_job_recovery_seconds_sum"] < 30
    assert got["ftrain_snapshot_stall_seconds_count"] >= 1
    assert got["ftrain_snapshot_commit_seconds_count"] >= 1
    assert got["ftrain_node_heartbeat_seconds_count"] >= 1 and got["ftrain_etcd_request_seconds_count"] >= 1
    # where the jobs' time went, and the node's
    assert got['ftrain_job_seconds_total{cause="training"}'] > 0
    assert got['ftrain_job_seconds_total{cause="recovering"}'] > 0
    assert got['ftrain_node_seconds_total{node="n0",state="busy"}'] > 0


def test_dashboard_marks_a_scale_up_and_a_drain_on_the_curves(control_plane, api, agents):
    agents(1)
    job_id = submit(api, train_spec("grows", 3000, every=10, delay_s=0.05, mx=2))
    with dashboard(control_plane) as page:
        sign_in(page, control_plane)
        page.goto(f"{control_plane.url}/ui/#/jobs/{job_id}")
        wait_points(page, 2)

        def changed(text: str) -> dict:
            """The job's event whose reason starts with `text`, once the group after it trains."""
            def seen():
                items = events(api, job_id)
                found = [i for i, e in enumerate(items) if e["reason"].startswith(text)]
                return found and any(e["reason"].startswith("training again")
                                     for e in items[found[-1]:]) and items[found[-1]]
            return wait_for(seen, 90, f"'{text}' and training again after it")

        agents(1)  # n1 joins the running job: a planned scale-up, no fault
        joined = changed("node(s) n1 joined; scaling up")
        api.post("/v1/nodes/n1/drain").raise_for_status()
        drained = changed("node(s) n1 drained;")
        assert job(api, job_id)["restarts"] == 0

        def placed():
            history = api.get(f"/v1/jobs/{job_id}/metrics").json()
            seen[:] = [(m["kind"], m["step"]) for m in marks(page, "loss")]
            return seen == [("scale-up", step_at(history, joined["time"])),
                            ("drain", step_at(history, drained["time"]))]
        seen: list = []
        try:
            wait_for(placed, 30, "a scale-up mark and a drain mark where the job's group changed")
        except AssertionError as exc:
            history = api.get(f"/v1/jobs/{job_id}/metrics").json()
            raise AssertionError(f"{exc}: the page marks {seen}; the events {events(api, job_id)}; "
                                 f"the history {history['steps']} {history['times']}") from None
        shown = marks(page, "loss")
        assert joined["reason"] in shown[0]["title"] and drained["reason"] in shown[1]["title"], shown
        key = page.eval_on_selector_all('[data-chart="loss"] .mark-key-item',
                                        "els => els.map(e => e.textContent)")
        assert key == ["+scale-up", "−drain"], key
        if os.environ.get("FTRAIN_SCREENSHOTS"):
            page.screenshot(path=str(Path(os.environ["FTRAIN_SCREENSHOTS"]) / "dashboard-resized-job.png"))
        api.post(f"/v1/jobs/{job_id}/cancel").raise_for_status()


def test_jobs_page_shows_the_queue_in_the_order_jobs_will_start_with_why_each_waits(control_plane, api):
    users = {}
    for name in ("ann", "bob"):
        resp = api.post("/v1/users", json={"name": name})
        assert resp.status_code == 201, resp.text
        users[name] = resp.json()["token"]
    submitted = []
    for owner in ("ann", "ann", "bob"):  # no node yet: all three wait
        with control_plane.client(users[owner]) as client:
            submitted.append(submit(client, {"name": f"of-{owner}", "command": ["true"]}))
    with dashboard(control_plane) as page:
        sign_in(page, control_plane)
        page.wait_for_selector(f'[data-queued="{submitted[2]}"]')
        order = page.eval_on_selector_all("#queue tbody tr", "els => els.map(e => e.dataset.queued)")
        # bob's job comes before ann's second: once ann's first starts, ann holds more
        assert order == [submitted[0], submitted[2], submitted[1]]
        why = page.text_content(f'[data-queued="{submitted[1]}"] [data-waiting]')
        assert "the cluster has 0 registered" in why
