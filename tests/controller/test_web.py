"""The web page end to end in real headless Chromium (selenium + chromedriver) against a real
controller process: a YAML with an error shows the field-path error inline; a valid one appears in
the job list; its page shows events and the log tail; the page runs under its Content-Security-Policy
without one violation, and keeps the token in this tab's sessionStorage, never localStorage."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.controller.e2e_helpers import Controller
from tests.controller.jobspecs import FAKE_WORKER, job_document

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


@pytest.fixture()
def browser(tmp_path: Path):
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip("chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # CSP violations land in the console
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'chrome-profile'}", "--window-size=1280,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


@pytest.mark.slow
def test_submit_shows_errors_inline_and_valid_jobs_appear_in_the_list(browser, tmp_path: Path) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.controller.conftest import ADMIN_TOKEN

    c = Controller(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "data", worker_command=FAKE_WORKER)
    # the list and job pages re-render on every poll: an element read between two renders is stale, not wrong
    wait = WebDriverWait(browser, 20, ignored_exceptions=(StaleElementReferenceException,))
    try:
        browser.get(c.url + "/")
        wait.until(ec.presence_of_element_located((By.ID, "token"))).send_keys(ADMIN_TOKEN)
        browser.find_element(By.CSS_SELECTOR, "#token-form button").click()

        bad = job_document("web-bad", args=["--steps", "2"])
        bad["metadata"]["project"] = "test"
        bad["spec"]["nodes"] = 0
        bad["spec"]["procesesPerNode"] = 1  # a typo
        spec_box = browser.find_element(By.ID, "spec")
        spec_box.send_keys(yaml.safe_dump(bad))
        browser.find_element(By.ID, "submit").click()
        errors = wait.until(ec.visibility_of_element_located((By.ID, "errors")))
        wait.until(lambda d: "spec.nodes" in d.find_element(By.ID, "errors").text)
        assert "spec.procesesPerNode: unknown field" in errors.text
        assert browser.find_elements(By.CSS_SELECTOR, "#jobs tbody tr") == []

        good = job_document("web-good", args=["--steps", "3"])
        good["metadata"]["project"] = "test"
        spec_box.clear()
        spec_box.send_keys(yaml.safe_dump(good))
        browser.find_element(By.ID, "submit").click()
        wait.until(lambda d: not d.find_element(By.ID, "errors").is_displayed())
        wait.until(lambda d: "web-good" in d.find_element(By.CSS_SELECTOR, "#jobs tbody tr").text)
        wait.until(lambda d: "SUCCEEDED" in d.find_element(By.CSS_SELECTOR, "#jobs tbody tr").text)

        # the job page: events, log tail and the heartbeat plot
        browser.find_element(By.LINK_TEXT, "web-good").click()
        wait.until(lambda d: "Succeeded" in d.find_element(By.ID, "events").text)
        wait.until(lambda d: "done" in d.find_element(By.ID, "log").text)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#plot polyline.series-loss"))
        assert "loss" in browser.find_element(By.ID, "plot-legend").text
        # the chart has axes with tick labels and units, and a hover value per heartbeat
        assert browser.find_elements(By.CSS_SELECTOR, "#plot text.tick-x")
        assert browser.find_elements(By.CSS_SELECTOR, "#plot text.tick-loss")
        assert "optimizer step" in browser.find_element(By.ID, "plot").text
        hover = browser.find_element(By.CSS_SELECTOR, "#plot circle.point-loss title").get_attribute("textContent")
        assert hover.startswith("step ") and "loss" in hover
        assert "succeeded at step 3" in browser.find_element(By.ID, "job-now").text
        # the goodput chart: the wall time since submit as a stacked bar on an axis of seconds
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#goodput rect.goodput-productive"))
        assert browser.find_elements(By.CSS_SELECTOR, "#goodput text.tick-goodput")
        assert "seconds since submit" in browser.find_element(By.ID, "goodput").text
        assert browser.find_element(By.ID, "goodput-legend").text.startswith("goodput ")
        bar = browser.find_element(By.CSS_SELECTOR, "#goodput rect.goodput-productive title")
        assert bar.get_attribute("textContent").startswith("productive training: ")

        # an unknown job shows none of the previous job's status or events
        browser.get(c.url + "/#/jobs/" + "0" * 32)
        wait.until(lambda d: "no job" in d.find_element(By.ID, "job-title").text)
        assert browser.find_element(By.ID, "job-phase").text == ""
        assert browser.find_elements(By.CSS_SELECTOR, "#events tbody tr") == []
        assert browser.find_element(By.ID, "log").text == ""

        # the job list's Step column
        browser.get(c.url + "/#/")
        wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "#jobs tbody tr td.step").text == "3")
    finally:
        c.stop()


def test_the_page_runs_under_its_csp_and_keeps_the_token_in_this_tab_only(browser, tmp_path: Path) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.controller.conftest import ADMIN_TOKEN

    c = Controller(f"sqlite:///{tmp_path / 'db.sqlite'}", tmp_path / "data", worker_command=FAKE_WORKER)
    # the list and job pages re-render on every poll: an element read between two renders is stale, not wrong
    wait = WebDriverWait(browser, 20, ignored_exceptions=(StaleElementReferenceException,))
    try:
        browser.get(c.url + "/")
        browser.execute_script("localStorage.setItem('deepfleet.token', 'left-by-an-older-page')")
        browser.refresh()
        wait.until(ec.presence_of_element_located((By.ID, "token"))).send_keys(ADMIN_TOKEN)
        browser.find_element(By.CSS_SELECTOR, "#token-form button").click()
        assert browser.execute_script("return sessionStorage.getItem('deepfleet.token')") == ADMIN_TOKEN
        assert browser.execute_script("return localStorage.getItem('deepfleet.token')") is None

        doc = job_document("web-csp", args=["--steps", "3"])
        doc["metadata"]["project"] = "test"
        job = c.client.submit(yaml.safe_dump(doc))["id"]
        browser.get(c.url + "/#/jobs/" + job)  # the same tab: the token is still there after a navigation
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#plot-legend .swatch"))
        color = browser.execute_script(  # in one call: the page redraws the legend every 2 s
            "return getComputedStyle(document.querySelector('#plot-legend .swatch')).color")
        assert color == "rgb(217, 72, 15)"  # the loss colour, set through CSSOM (the CSP blocks style attributes)
        assert browser.find_element(By.ID, "events").text

        browser.switch_to.new_window("tab")  # another tab starts without the token
        browser.get(c.url + "/")
        wait.until(ec.presence_of_element_located((By.ID, "token")))
        assert browser.find_element(By.ID, "token").get_attribute("value") == ""
        assert browser.execute_script("return sessionStorage.getItem('deepfleet.token')") is None

        violations = [e["message"] for e in browser.get_log("browser") if "Content Security Policy" in e["message"]]
        assert violations == []
    finally:
        c.stop()
