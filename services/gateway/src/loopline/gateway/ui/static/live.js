// Keeps an open dashboard page up to date: one EventSource per page (the browser reconnects it by
// itself); each "sections" message carries the server-rendered HTML of the parts that changed,
// which replace the old ones, so a page left open holds no more nodes than when it loaded.
(function () {
  "use strict";
  var main = document.getElementById("main");
  var status = document.getElementById("live-status");
  if (!main || !main.dataset.live || !window.EventSource) return;
  var updates = 0;
  var source = new EventSource(main.dataset.live);
  function say(text) { if (status) status.textContent = text; }
  say("connecting…");
  source.onopen = function () { say("live"); };
  source.onerror = function () { say("connection lost: reconnecting…"); };
  source.addEventListener("trouble", function (message) { say(JSON.parse(message.data)); });
  source.addEventListener("sections", function (message) {
    var sections = JSON.parse(message.data);
    Object.keys(sections).forEach(function (id) {
      var element = document.getElementById(id);
      if (element) element.innerHTML = sections[id];
    });
    updates += 1;
    document.body.dataset.updates = String(updates);
    say("live · updated " + new Date().toLocaleTimeString());
  });
  window.addEventListener("pagehide", function () { source.close(); });
})();
