package main

// Admission: admissionregistration.k8s.io/v1 webhook configurations are
// stored like any other object, and upstream's ValidatingAdmissionWebhook and
// MutatingAdmissionWebhook plugins (k8s.io/apiserver) call the webhooks they
// name on every create/update/delete, subresources (pods/binding,
// pods/resize) included. The plugins read the configurations through
// informers over this server's own loopback client.
//
// Upstream kube-apiserver defaults and validates webhook configurations with
// code from k8s.io/kubernetes, which Debian does not package; the subset the
// plugins rely on is here (a nil namespaceSelector would match nothing, a nil
// sideEffects would crash a dry run).

import (
	"fmt"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation/field"
	webhookinit "k8s.io/apiserver/pkg/admission/plugin/webhook/initializer"
	mutatingwebhook "k8s.io/apiserver/pkg/admission/plugin/webhook/mutating"
	validatingwebhook "k8s.io/apiserver/pkg/admission/plugin/webhook/validating"
	genericapiserver "k8s.io/apiserver/pkg/server"
	genericoptions "k8s.io/apiserver/pkg/server/options"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/apiserver/pkg/util/webhook"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
)

// setupAdmission installs the webhook admission plugins on cfg. Only the two
// webhook plugins run (no NamespaceLifecycle, no admission policies: this
// server does not serve their objects).
func setupAdmission(cfg *genericapiserver.RecommendedConfig, loopback *rest.Config, auth webhook.AuthenticationInfoResolverWrapper) error {
	client, err := kubernetes.NewForConfig(loopback)
	if err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(loopback)
	if err != nil {
		return err
	}
	factory := informers.NewSharedInformerFactory(client, 0)
	// Started by the generic server's post-start hook.
	cfg.SharedInformerFactory = factory

	opts := genericoptions.NewAdmissionOptions()
	opts.RecommendedPluginOrder = []string{mutatingwebhook.PluginName, validatingwebhook.PluginName}
	opts.EnablePlugins = opts.RecommendedPluginOrder
	return opts.ApplyTo(&cfg.Config, factory, client, dyn, utilfeature.DefaultFeatureGate, cfg.EffectiveVersion,
		webhookinit.NewPluginInitializer(auth, noServices{}))
}

// ---- defaults and validation of webhook configurations ----

func defaultRules(rules []admissionregistrationv1.RuleWithOperations) {
	for i := range rules {
		if rules[i].Scope == nil {
			s := admissionregistrationv1.AllScopes
			rules[i].Scope = &s
		}
	}
}

func defaultSelectors(ns, obj **metav1.LabelSelector) {
	if *ns == nil {
		*ns = &metav1.LabelSelector{}
	}
	if *obj == nil {
		*obj = &metav1.LabelSelector{}
	}
}

func defaultCommon(fp **admissionregistrationv1.FailurePolicyType, mp **admissionregistrationv1.MatchPolicyType,
	timeout **int32, cc *admissionregistrationv1.WebhookClientConfig) {
	if *fp == nil {
		f := admissionregistrationv1.Fail
		*fp = &f
	}
	if *mp == nil {
		m := admissionregistrationv1.Equivalent
		*mp = &m
	}
	if *timeout == nil {
		t := int32(10)
		*timeout = &t
	}
	if cc.Service != nil && cc.Service.Port == nil {
		p := int32(443)
		cc.Service.Port = &p
	}
}

func webhookConfigDefaults(obj runtime.Object) {
	switch c := obj.(type) {
	case *admissionregistrationv1.ValidatingWebhookConfiguration:
		for i := range c.Webhooks {
			w := &c.Webhooks[i]
			defaultRules(w.Rules)
			defaultSelectors(&w.NamespaceSelector, &w.ObjectSelector)
			defaultCommon(&w.FailurePolicy, &w.MatchPolicy, &w.TimeoutSeconds, &w.ClientConfig)
		}
	case *admissionregistrationv1.MutatingWebhookConfiguration:
		for i := range c.Webhooks {
			w := &c.Webhooks[i]
			defaultRules(w.Rules)
			defaultSelectors(&w.NamespaceSelector, &w.ObjectSelector)
			defaultCommon(&w.FailurePolicy, &w.MatchPolicy, &w.TimeoutSeconds, &w.ClientConfig)
			if w.ReinvocationPolicy == nil {
				r := admissionregistrationv1.NeverReinvocationPolicy
				w.ReinvocationPolicy = &r
			}
		}
	}
}

func validateWebhook(p *field.Path, name string, seen map[string]bool, se *admissionregistrationv1.SideEffectClass,
	versions []string, cc admissionregistrationv1.WebhookClientConfig, timeout *int32) field.ErrorList {
	var errs field.ErrorList
	if name == "" {
		errs = append(errs, field.Required(p.Child("name"), ""))
	} else if seen[name] {
		errs = append(errs, field.Duplicate(p.Child("name"), name))
	}
	seen[name] = true
	if se == nil {
		errs = append(errs, field.Required(p.Child("sideEffects"), "must be None or NoneOnDryRun"))
	} else if *se != admissionregistrationv1.SideEffectClassNone && *se != admissionregistrationv1.SideEffectClassNoneOnDryRun {
		errs = append(errs, field.NotSupported(p.Child("sideEffects"), *se, []string{"None", "NoneOnDryRun"}))
	}
	ok := false
	for _, v := range versions {
		ok = ok || v == "v1" || v == "v1beta1"
	}
	if !ok {
		errs = append(errs, field.Required(p.Child("admissionReviewVersions"), "must include v1 or v1beta1"))
	}
	if (cc.URL == nil) == (cc.Service == nil) {
		errs = append(errs, field.Required(p.Child("clientConfig"), "exactly one of url or service is required"))
	}
	if timeout != nil && (*timeout < 1 || *timeout > 30) {
		errs = append(errs, field.Invalid(p.Child("timeoutSeconds"), *timeout, "must be between 1 and 30 seconds"))
	}
	return errs
}

func validateWebhookConfig(obj, _ runtime.Object) field.ErrorList {
	var errs field.ErrorList
	seen := map[string]bool{}
	switch c := obj.(type) {
	case *admissionregistrationv1.ValidatingWebhookConfiguration:
		for i, w := range c.Webhooks {
			errs = append(errs, validateWebhook(field.NewPath("webhooks").Index(i), w.Name, seen, w.SideEffects,
				w.AdmissionReviewVersions, w.ClientConfig, w.TimeoutSeconds)...)
		}
	case *admissionregistrationv1.MutatingWebhookConfiguration:
		for i, w := range c.Webhooks {
			errs = append(errs, validateWebhook(field.NewPath("webhooks").Index(i), w.Name, seen, w.SideEffects,
				w.AdmissionReviewVersions, w.ClientConfig, w.TimeoutSeconds)...)
		}
	}
	return errs
}

// ---- pods/resize: in-place update of container resources ----

// resizePod keeps everything of the stored pod but the containers'
// resources and resize policies, as upstream's resize strategy does.
func resizePod(obj, old runtime.Object) {
	np, op := obj.(*corev1.Pod), old.(*corev1.Pod)
	byName := map[string]corev1.Container{}
	for _, c := range np.Spec.Containers {
		byName[c.Name] = c
	}
	spec := *op.Spec.DeepCopy()
	for i := range spec.Containers {
		if c, ok := byName[spec.Containers[i].Name]; ok {
			spec.Containers[i].Resources = c.Resources
			spec.Containers[i].ResizePolicy = c.ResizePolicy
		}
	}
	np.Spec = spec
	np.Status = op.Status
	np.Labels, np.Annotations = op.Labels, op.Annotations
}

// podQOS is the pod's QoS class (upstream's rule, for cpu and memory).
func podQOS(p *corev1.Pod) corev1.PodQOSClass {
	requests, limits, guaranteed := false, false, true
	for _, c := range p.Spec.Containers {
		for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
			req, hasReq := c.Resources.Requests[r]
			lim, hasLim := c.Resources.Limits[r]
			requests = requests || (hasReq && !req.IsZero())
			limits = limits || (hasLim && !lim.IsZero())
			if !hasLim || (hasReq && req.Cmp(lim) != 0) {
				guaranteed = false
			}
		}
	}
	switch {
	case !requests && !limits:
		return corev1.PodQOSBestEffort
	case guaranteed:
		return corev1.PodQOSGuaranteed
	}
	return corev1.PodQOSBurstable
}

func validateResize(obj, old runtime.Object) field.ErrorList {
	np, op := obj.(*corev1.Pod), old.(*corev1.Pod)
	var errs field.ErrorList
	if q, oq := podQOS(np), podQOS(op); q != oq {
		errs = append(errs, field.Forbidden(field.NewPath("spec", "containers"),
			fmt.Sprintf("resize may not change the pod's QoS class (%s to %s)", oq, q)))
	}
	if op.Status.Phase == corev1.PodSucceeded || op.Status.Phase == corev1.PodFailed {
		errs = append(errs, field.Forbidden(field.NewPath("spec"), "a terminated pod cannot be resized"))
	}
	return errs
}
