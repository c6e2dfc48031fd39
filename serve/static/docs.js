// The API's interactive docs (/docs): Swagger UI from the swagger-ui-py package, served by this
// service itself (no CDN), started here rather than inline so the page policy needs no exception.
(function () {
  const root = document.getElementById('swagger-ui');
  window.ui = SwaggerUIBundle({
    url: root.dataset.schema,
    dom_id: '#swagger-ui',
    deepLinking: true,
    presets: [SwaggerUIBundle.presets.apis],
    layout: 'BaseLayout',
  });
})();
