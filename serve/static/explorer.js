// Live refresh: every element with data-refresh="URL" is redrawn from that URL (a server-rendered
// fragment) every few seconds while the page's "live" box is ticked. No framework, no build step.
(function () {
  const PERIOD_MS = 2000;
  function live() {
    const box = document.getElementById('live');
    return box === null || box.checked;
  }
  async function refresh(element) {
    try {
      const response = await fetch(element.dataset.refresh, { credentials: 'same-origin' });
      if (response.ok) {
        element.innerHTML = await response.text();
        element.dispatchEvent(new CustomEvent('refreshed', { bubbles: true }));
      }
    } catch (err) {
      // the service is restarting: keep the last view and try again next period
    }
  }
  function tick() {
    if (document.visibilityState === 'visible' && live()) {
      document.querySelectorAll('[data-refresh]').forEach(refresh);
    }
  }
  document.addEventListener('DOMContentLoaded', function () {
    if (document.querySelector('[data-refresh]') !== null) {
      setInterval(tick, PERIOD_MS);
    }
  });
})();
